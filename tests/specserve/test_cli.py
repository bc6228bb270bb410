"""The ``specserve`` command line: generate, up, serve, and their errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from asyncio.subprocess import PIPE

import pytest
import pytest_asyncio

from specserve import cli

# --------------------------------------------------------------------------- without a stack


def test_up_without_redis_server_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    """No redis-server on PATH and no --redis-url: a clear error before anything starts."""
    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    code = cli.main(
        [
            "up",
            "--port",
            "0",
            "--target-model",
            str(tmp_path / "target"),
            "--draft-model",
            str(tmp_path / "draft"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "redis-server is not installed" in err
    assert "apt-get install redis-server" in err and "--redis-url" in err


def test_up_without_models_says_which_flags_or_script(monkeypatch, capsys, tmp_path):
    import specserve.models

    monkeypatch.setattr(specserve.models, "DEMO_MODELS_DIR", tmp_path / "nowhere")
    assert cli.main(["up"]) == 2
    err = capsys.readouterr().err
    assert "--target-model DIR --draft-model DIR" in err
    assert "scripts/train_demo_pair.py" in err


def test_up_needs_both_model_flags(capsys, tmp_path):
    assert cli.main(["up", "--target-model", str(tmp_path)]) == 2
    assert "pass both --target-model DIR and --draft-model DIR" in capsys.readouterr().err


def test_serve_reads_flags_over_environment(monkeypatch):
    from specserve.config import CoordinatorSettings

    monkeypatch.setenv("SPECSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("SPECSERVE_PORT", "1234")
    parser = cli._role_parser("coordinator", CoordinatorSettings)
    options = parser.parse_args(["--port", "4321", "--target-endpoints", "a:1,b:2", "--auth-tokens", "t1"])
    settings = CoordinatorSettings(**{k: v for k, v in vars(options).items() if v is not None})
    assert settings.port == 4321  # the flag wins
    assert settings.max_batch_size == 7  # the environment fills the rest
    assert settings.target_endpoints == ["a:1", "b:2"]


def test_serve_with_bad_settings_says_what_is_wrong(capsys):
    assert cli.main(["serve", "target", "--port", "70000", "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert "invalid target settings" in err and "port" in err


def test_generate_against_a_dead_address_fails_cleanly(capsys):
    from redis_server import free_port

    assert cli.main(["generate", "hi", "--addr", f"127.0.0.1:{free_port()}", "--retries", "0"]) == 1
    assert "error: Unavailable: " in capsys.readouterr().err


def test_gamma_flag_parsing():
    assert cli._parse_gamma("auto") is None
    assert cli._parse_gamma("3") == 3
    with pytest.raises(cli.CliError, match="--gamma must be"):
        cli._parse_gamma("lots")


# --------------------------------------------------------------------------- against real servers

module_loop = pytest.mark.asyncio(loop_scope="module")

#: Prepended to a subprocess's code: torch and the serving stack cannot be imported there.
HIDE_SERVING_STACK = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers", "redis", "structlog", "numpy", "pydantic"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
sys.meta_path.insert(0, _Hide())
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tmp_path_factory):
    import system_fixtures as sf

    return sf.tiny_pair(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(redis_server, pair):
    import system_fixtures as sf

    async with sf.local_stack(pair, redis_server.url) as s:
        yield s


async def run(args: list[str], *, cwd, prelude: str = "") -> tuple[int, str, str]:
    code = prelude + "import sys\nfrom specserve.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, cwd=cwd, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    return proc.returncode, out.decode(), err.decode()


@module_loop
async def test_generate_streams_text_to_stdout_and_stats_to_stderr_without_torch(stack, tmp_path):
    from specserve import AsyncClient

    prompt = "def add(a, b):\n"
    args = ["generate", prompt, "--addr", stack.address, "--temperature", "0", "--max-new-tokens", "9"]
    code, out, err = await run([*args, "--gamma", "2", "--json"], cwd=tmp_path, prelude=HIDE_SERVING_STACK)
    assert code == 0, err
    async with AsyncClient(stack.address) as client:
        expected = await client.generate(prompt, max_new_tokens=9, temperature=0, gamma=2)
    assert out == expected.text + "\n"
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["completion_tokens"] == 9 and stats["finish_reason"] == "length"
    assert stats["rounds"] >= 1 and len(stats["accepted_per_position"]) >= 1

    code, out, err = await run([*args, "--proposer", "ngram", "--seed", "5"], cwd=tmp_path)
    assert code == 0, err
    assert out == expected.text + "\n"
    assert "draft tokens proposed" in err and "seed 5" in err

    code, out, err = await run([*args, "--top-p", "0"], cwd=tmp_path)
    assert code == 1
    assert "error: InvalidArgument: top_p must be in (0, 1]" in err


@module_loop
async def test_generate_reads_the_prompt_from_stdin(stack, monkeypatch, capsys):
    import io

    import structlog

    from specserve import AsyncClient

    prompt = "class Point:\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    args = ["generate", "-", "--addr", stack.address, "--temperature", "0", "--max-new-tokens", "5"]
    with structlog.testing.capture_logs():  # the servers share this process's stdout
        assert await asyncio.to_thread(cli.main, args) == 0
    captured = capsys.readouterr()
    async with AsyncClient(stack.address) as client:
        expected = await client.generate(prompt, max_new_tokens=5, temperature=0)
    assert captured.out == expected.text + "\n"
    assert "tokens 5 (prompt" in captured.err


@pytest.mark.slow  # a subprocess that imports torch
@module_loop
async def test_up_serves_with_a_private_redis_and_stops_on_sigterm(pair, tmp_path):
    from redis_server import free_port

    from specserve import AsyncClient

    port = free_port()
    code = "import sys\nfrom specserve.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    args = [
        "up",
        "--port",
        str(port),
        "--target-model",
        str(pair.target_dir),
        "--draft-model",
        str(pair.draft_dir),
    ]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, cwd=tmp_path, stdout=PIPE, stderr=PIPE
    )
    try:
        lines: list[str] = []
        while not any(line.startswith("stop with Ctrl-C") for line in lines):
            line = await asyncio.wait_for(proc.stdout.readline(), 180)
            assert line, f"up exited early: {(await proc.stderr.read()).decode()}"
            lines.append(line.decode())
        assert f"serving on 127.0.0.1:{port}" in lines[0]
        redis_url = re.search(r"redis://127\.0\.0\.1:(\d+)/0", "".join(lines))
        assert redis_url, lines
        redis_port = int(redis_url.group(1))

        async with AsyncClient(f"127.0.0.1:{port}") as client:
            result = await client.generate("for i in range(3):\n", max_new_tokens=6, temperature=0)
        assert len(result.token_ids) == 6
        with socket.create_connection(("127.0.0.1", redis_port), timeout=2):
            pass  # the private redis-server is up

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        assert "stopping" in (await proc.stdout.read()).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    with pytest.raises(OSError):  # the private redis-server went away with it
        socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()


def test_demo_streams_a_completion_and_compares_with_the_target_alone(pair, capsys, monkeypatch):
    """In this process (the subprocess path is covered by ``up`` above); its own private redis-server."""
    import structlog

    import specserve.logs

    monkeypatch.setattr(specserve.logs, "configure_logging", lambda *a, **k: None)  # leave the test's logging
    args = ["demo", "--target-model", str(pair.target_dir), "--draft-model", str(pair.draft_dir)]
    with structlog.testing.capture_logs():  # keep log lines out of the captured stdout
        assert cli.main([*args, "--prompt", "def f(x):\n", "--max-new-tokens", "8", "--gamma", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):\n")
    assert "-- speculative decoding (draft + target) --" in out
    assert "-- the target alone (gamma = 0), same request --" in out
    assert "accepted per position" in out and "tokens/s" in out
    assert "greedy output identical to the target alone" in out
    assert re.search(r"tokens 8 \(prompt \d+\)", out)


@pytest.mark.slow  # a subprocess that imports torch
@module_loop
async def test_serve_runs_one_role_from_environment_and_flags_until_sigterm(pair, redis_server, tmp_path):
    """``specserve serve draft`` as a container runs it: settings from SPECSERVE_* plus flags."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from redis_server import free_port

    port = free_port()
    env = {
        **os.environ,
        "SPECSERVE_REDIS_URL": redis_server.url,
        "SPECSERVE_MODEL": str(pair.draft_dir),
        "SPECSERVE_PORT": "1",  # the flag below wins
        "SPECSERVE_LOG_FORMAT": "json",
    }
    code = "import sys\nfrom specserve.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    args = ["serve", "draft", "--host", "127.0.0.1", "--port", str(port), "--no-warmup", "--device", "cpu"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, cwd=tmp_path, env=env, stdout=PIPE, stderr=PIPE
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="specserve.v1.DraftService")
            reply = await health.Check(request, timeout=180, wait_for_ready=True)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        logs = (await proc.stderr.read()).decode()
        events = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        assert any(e.get("event") == "server_started" for e in events), logs  # JSON, as configured
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_up_on_a_busy_port_says_to_pick_another(pair, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["up", "--port", str(port), "--target-model", str(pair.target_dir)]
        assert cli.main([*args, "--draft-model", str(pair.draft_dir)]) == 2
    err = capsys.readouterr().err
    assert f"could not listen on 127.0.0.1:{port}" in err
    assert "Pass --port with a free port" in err
