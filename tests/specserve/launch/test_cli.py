"""The ``specserve`` command line: generate, up, serve, and their errors."""

from __future__ import annotations

import argparse
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

from specserve.launch import cli


@pytest.fixture(autouse=True)
def _keep_log_config():
    """Commands that load models configure structlog for the process; leave the next test the config it had."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# --------------------------------------------------------------------------- without a stack


@pytest.mark.unit
def test_up_without_any_redis_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    """No server on PATH, none in the installed wheels, no --redis-url: a clear error before anything starts."""
    from specserve.launch import redis_server

    (tmp_path / "target").mkdir()
    (tmp_path / "draft").mkdir()
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setattr(redis_server, "_packaged", lambda module, binary: None)  # as if not installed
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
    assert "no Redis-compatible server found" in err
    assert "[serve]" in err and "--redis-url" in err


@pytest.mark.unit
def test_the_server_binary_comes_from_a_wheel_when_path_has_none(tmp_path, monkeypatch):
    from specserve.launch.redis_server import find_server_binary

    monkeypatch.setenv("PATH", str(tmp_path))
    binary = find_server_binary()
    assert binary is not None and "site-packages" in str(binary)
    assert binary.name in ("redis-server", "valkey-server")


@pytest.mark.unit
def test_up_with_a_missing_model_directory_says_what_is_accepted(capsys, tmp_path):
    assert cli.main(["up", "--target-model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "neither a registered name" in err and "smollm2-135m-instruct" in err


@pytest.mark.unit
def test_models_list_and_path(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_MODEL_CACHE", str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "specserve-smollm2-draft" in out
    assert f"{tmp_path}/smollm2-135m-instruct (missing" in out
    assert cli.main(["models", "path", "smollm2-135m-instruct"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "smollm2-135m-instruct")
    assert cli.main(["models", "path", "nope"]) == 2
    assert "no registered model named 'nope'" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("command", [["models", "fetch", "smollm2-135m-instruct"], ["demo"]])
def test_a_model_fetch_from_the_cli_prints_each_progress_message_once(command, capsys, monkeypatch):
    """The fetch's progress lines go to stderr once: its debug log line of the same message stays out
    (structlog's default, before the command configured logging, printed both)."""
    import structlog

    from specserve.engine import model_registry

    structlog.reset_defaults()  # a process where nothing configured logging yet

    def fetch(self, *, force=False, wheel=None, progress=True):
        model_registry._say(progress, "downloading the wheel")
        raise model_registry.FailedPrecondition("no index here")  # stop before anything starts

    monkeypatch.setattr(model_registry.IndexGGUF, "present", lambda self: False)
    monkeypatch.setattr(model_registry.IndexGGUF, "fetch", fetch)
    assert cli.main(command) == 2
    out, err = capsys.readouterr()
    assert (out + err).count("downloading the wheel") == 1 and "no index here" in err
    assert "[specserve models] downloading the wheel" in err


@pytest.mark.unit
def test_serve_reads_flags_over_environment(monkeypatch):
    from specserve.runtime.config import CoordinatorSettings

    monkeypatch.setenv("SPECSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("SPECSERVE_PORT", "1234")
    parser = cli._role_parser("coordinator", CoordinatorSettings)
    options = parser.parse_args(["--port", "4321", "--target-endpoints", "a:1,b:2", "--auth-tokens", "t1"])
    settings = CoordinatorSettings(**{k: v for k, v in vars(options).items() if v is not None})
    assert settings.port == 4321  # the flag wins
    assert settings.max_batch_size == 7  # the environment fills the rest
    assert settings.target_endpoints == ["a:1", "b:2"]


@pytest.mark.unit
def test_serve_coordinator_takes_the_http_port_from_a_flag_or_the_environment(monkeypatch):
    from specserve.runtime.config import CoordinatorSettings

    parser = cli._role_parser("coordinator", CoordinatorSettings)
    assert CoordinatorSettings(host="127.0.0.1").http_port is None, "off unless asked for"
    options = parser.parse_args(["--http-port", "8080", "--served-model-name", "m", "--host", "127.0.0.1"])
    settings = CoordinatorSettings(**{k: v for k, v in vars(options).items() if v is not None})
    assert settings.http_port == 8080 and settings.served_model_name == "m"
    monkeypatch.setenv("SPECSERVE_HTTP_PORT", "9000")
    assert CoordinatorSettings(host="127.0.0.1").http_port == 9000


@pytest.mark.unit
def test_serve_with_bad_settings_says_what_is_wrong(capsys):
    assert cli.main(["serve", "target", "--port", "70000", "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert "invalid target settings" in err and "port" in err


@pytest.mark.system
def test_generate_against_a_dead_address_fails_cleanly(capsys):
    from specserve.launch.redis_server import free_port

    assert cli.main(["generate", "hi", "--addr", f"127.0.0.1:{free_port()}", "--retries", "0"]) == 1
    assert "error: Unavailable: " in capsys.readouterr().err


@pytest.mark.unit
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
    code = prelude + "import sys\nfrom specserve.launch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
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

    # --sampling-mode reaches the server: a coupled sampled completion equals the target alone's.
    sampled = ["generate", prompt, "--addr", stack.address, "--temperature", "1", "--max-new-tokens", "9"]
    code, out, err = await run(
        [*sampled, "--seed", "5", "--gamma", "3", "--sampling-mode", "coupled"], cwd=tmp_path
    )
    assert code == 0, err
    async with AsyncClient(stack.address) as client:
        alone = await client.generate(prompt, max_new_tokens=9, seed=5, gamma=0, sampling_mode="coupled")
    assert out == alone.text + "\n"
    code, out, err = await run([*sampled, "--sampling-mode", "exact"], cwd=tmp_path)
    assert code == 2 and "invalid choice: 'exact'" in err


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


@module_loop
async def test_generate_chat_sends_the_prompt_as_a_user_message(stack, tmp_path):
    from specserve import AsyncClient

    args = ["generate", "def add(a, b):", "--chat", "--system", "you write python", "--addr", stack.address]
    args += ["--temperature", "0", "--max-new-tokens", "7", "--ignore-eos", "--json"]
    code, out, err = await run(args, cwd=tmp_path, prelude=HIDE_SERVING_STACK)
    assert code == 0, err
    messages = [
        {"role": "system", "content": "you write python"},
        {"role": "user", "content": "def add(a, b):"},
    ]
    async with AsyncClient(stack.address) as client:
        expected = await client.chat(messages, max_new_tokens=7, temperature=0, ignore_eos=True)
        plain = await client.generate("def add(a, b):", max_new_tokens=7, temperature=0, ignore_eos=True)
    assert out == expected.text + "\n"
    assert json.loads(err.strip().splitlines()[-1])["prompt_tokens"] == expected.stats.prompt_tokens
    assert expected.stats.prompt_tokens > plain.stats.prompt_tokens  # the template wrapped the prompt

    code, _, err = await run(["generate", "x", "--system", "s", "--addr", stack.address], cwd=tmp_path)
    assert code == 2 and "--system needs --chat" in err


@module_loop
async def test_chat_keeps_the_conversation_and_resets_it(stack, tmp_path):
    """Lines on stdin are user messages; each reply is one stdout line, stats go to stderr."""
    from specserve import AsyncClient

    kw = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    args = ["chat", "--addr", stack.address, "--temperature", "0", "--max-new-tokens", "6", "--ignore-eos"]
    stdin = "def add(a, b):\n\nclass Point:\n/reset\nclass Point:\n/exit\nnever sent\n"
    code = HIDE_SERVING_STACK + "import sys\nfrom specserve.launch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, cwd=tmp_path, stdin=PIPE, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 180)
    assert proc.returncode == 0, err.decode()
    async with AsyncClient(stack.address) as client:
        first = [{"role": "user", "content": "def add(a, b):"}]
        reply1 = (await client.chat(first, **kw)).text
        second = [
            *first,
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": "class Point:"},
        ]
        reply2 = (await client.chat(second, **kw)).text
        fresh = (await client.chat([{"role": "user", "content": "class Point:"}], **kw)).text
    assert out.decode() == f"{reply1}\n{reply2}\n{fresh}\n"
    assert reply2 != fresh, "precondition: with the first turn in context the reply differs"
    text = err.decode()
    assert "/reset starts a new conversation" in text and "(new conversation)" in text
    assert text.count("tokens/round") == 3


@pytest.mark.system
@pytest.mark.slow  # a subprocess that imports torch
@module_loop
async def test_up_serves_with_a_private_redis_and_stops_on_sigterm(pair, tmp_path):
    from specserve import AsyncClient
    from specserve.launch.redis_server import free_port

    port, http_port = free_port(), free_port()
    code = "import sys\nfrom specserve.launch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    args = [
        "up",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
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
        # The OpenAI-compatible API is on by default, at the printed URL, with the same model.
        url = f"http://127.0.0.1:{http_port}/v1"
        assert any(line.startswith(f"OpenAI-compatible API: {url}") for line in lines), lines
        import httpx

        async with httpx.AsyncClient(timeout=60) as http:
            body = {"prompt": "for i in range(3):\n", "max_tokens": 6, "temperature": 0}
            reply = (await http.post(f"{url}/completions", json=body)).json()
        assert reply["choices"][0]["text"] == result.text
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


@pytest.mark.system
def test_demo_runs_each_scenario_beside_the_target_alone(pair, capsys, monkeypatch):
    """In this process (the subprocess path is covered by ``up`` above); its own private redis-server."""
    import structlog

    import specserve.runtime.logs
    from specserve.launch.demo import SCENARIOS

    monkeypatch.setattr(specserve.runtime.logs, "configure_logging", lambda *a, **k: None)  # leave the test's logging
    args = ["demo", "--target-model", str(pair.target_dir), "--draft-model", str(pair.draft_dir)]
    with structlog.testing.capture_logs():  # keep log lines out of the captured stdout
        assert cli.main([*args, "--max-new-tokens", "8", "--gamma", "3"]) == 0
    out = capsys.readouterr().out
    for i, scenario in enumerate(SCENARIOS, 1):
        assert f"== {i}. {scenario.title} ==" in out
        assert f"user> {scenario.messages[-1]['content']}" in out
    # A fixed gamma is a request for the draft model's proposals: no prompt lookup in any of the three.
    assert out.count("-- speculative decoding (draft model, gamma 3) --") == 3
    assert out.count("-- the target alone: HF generate(), stock transformers, float32, in this process --") == 3
    assert out.count("-- the target alone through this service (gamma = 0), same request --") == 3
    assert out.count("x HF generate() | output identical to the target alone's") == 3
    assert len(re.findall(r"tokens 8 \(prompt \d+\)", out)) == 6
    assert (
        "== summary (speedup: over HF generate(), the target alone) ==" in out
        and "every speculative output was token-identical to the target alone, as it must be" in out
    )
    coupled = ["--temperature", "1", "--seed", "3", "--sampling-mode", "coupled", "--gamma", "3"]
    with structlog.testing.capture_logs():
        assert cli.main([*args, "--max-new-tokens", "8", *coupled]) == 0
    out = capsys.readouterr().out
    assert out.count("output identical to the target alone's") == 3, "coupled: the same seed, the same text"


@pytest.mark.slow  # a subprocess that imports torch
@module_loop
async def test_serve_runs_one_role_from_environment_and_flags_until_sigterm(pair, redis_server, tmp_path):
    """``specserve serve draft`` as a container runs it: settings from SPECSERVE_* plus flags."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specserve.launch.redis_server import free_port

    port = free_port()
    env = {
        **os.environ,
        "SPECSERVE_REDIS_URL": redis_server.url,
        "SPECSERVE_MODEL": str(pair.draft_dir),
        "SPECSERVE_PORT": "1",  # the flag below wins
        "SPECSERVE_LOG_FORMAT": "json",
    }
    code = "import sys\nfrom specserve.launch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
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


@pytest.mark.system
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


@pytest.mark.unit
def test_http_port_flag_parsing():
    assert cli._http_port("off") is None
    assert cli._http_port("0") == 0 and cli._http_port("8000") == 8000
    for bad in ("lots", "70000", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._http_port(bad)
    assert cli.build_parser().parse_args(["up"]).http_port == 8000  # on by default
    assert cli.build_parser().parse_args(["up", "--http-port", "off"]).http_port is None


@pytest.mark.system
def test_up_on_a_busy_http_port_says_to_pick_another(pair, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["up", "--port", "0", "--http-port", str(port), "--target-model", str(pair.target_dir)]
        assert cli.main([*args, "--draft-model", str(pair.draft_dir)]) == 2
    err = capsys.readouterr().err
    assert f"could not bind the HTTP API to 127.0.0.1:{port}" in err
    assert "pass --http-port with a free port" in err


def demo_result(
    total_ns: int,
    *,
    rounds: int = 40,
    proposed: int = 0,
    accepted: int = 0,
    draft_rounds: int = 0,
    lookup: bool = False,
    proposer: str = "",
):
    """A request's result for the demo's summary: 40 tokens in ``total_ns``; ``lookup``: the proposals were the
    prompt lookup's (the hybrid lookup), else the draft model's over ``draft_rounds`` rounds."""
    from specserve.client import GenerateResult, GenerationStats

    stats = GenerationStats(
        session_id="s",
        prompt_tokens=4,
        completion_tokens=40,
        rounds=rounds,
        proposed_tokens=proposed,
        accepted_tokens=accepted,
        accepted_per_position=(),
        draft_ns=0,
        verify_ns=0,
        queue_ns=0,
        first_token_ns=0,
        total_ns=total_ns,
        finish_reason="length",
        seed=1,
        draft_rounds=draft_rounds,
        lookup_proposed_tokens=proposed if lookup else 0,
        lookup_accepted_tokens=accepted if lookup else 0,
        proposer=proposer,
    )
    return GenerateResult(text="", token_ids=(1,) * 40, stats=stats)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("draft_rounds", "verdict"),
    [
        (0, "fell back to gamma 0, as it should"),
        (3, "drafted in 3 of 40 rounds of those requests, its occasional probes"),
        (20, "it still drafted in 20 of 40 rounds"),
    ],
)
def test_the_demo_summary_tells_probes_from_speculating(draft_rounds, verdict):
    """Where the draft does not pay, the summary says whether the policy fell back: a few probe rounds are
    not speculating; half the rounds drafting is."""
    from specserve.launch.demo import SCENARIOS, Outcome, summary

    chat = next(s for s in SCENARIOS if s.proposer is None)
    drafted = demo_result(2_200_000_000, proposed=draft_rounds, draft_rounds=draft_rounds)
    outcome = Outcome(chat, drafted, demo_result(2_000_000_000))
    text = summary([outcome])
    assert "the draft model does not pay" in text and verdict in text
    assert "noise" not in text, "0.91x is not a gain to explain away"
    lucky = summary([Outcome(chat, demo_result(1_600_000_000), demo_result(2_000_000_000))])
    assert (
        "at best 1.25x gamma 0 through this service, the target alone (no draft token was accepted, so the "
        "difference is the machine's noise)" in lucky
    )
    # With the baseline outside the service, the verdict names it.
    from specserve.launch.baseline import Baseline

    hf = Baseline((1,) * 40, 1.8)
    named = summary([Outcome(chat, drafted, demo_result(2_000_000_000), hf)])
    assert "at best 0.82x HF generate(), the target alone" in named and "over HF generate()" in named


@pytest.mark.unit
def test_the_demo_names_the_proposer_the_server_defaulted_to():
    """The demo's requests name no proposer: what drafted them is what the statistics say (the draft model
    from a server that does not say), in the request's heading, the summary's table and its verdict."""
    from specserve.launch.demo import SCENARIOS, Outcome, _proposer, summary

    chat = SCENARIOS[0]
    head = demo_result(2_200_000_000, proposed=3, draft_rounds=3, proposer="feature")
    assert _proposer(chat, head) == "feature head" and _proposer(chat, head, short=True) == "feature"
    text = summary([Outcome(chat, head, demo_result(2_000_000_000))])
    assert "the feature head does not pay: at best 0.91x gamma 0 through this service" in text
    assert re.search(r"a chat answer +feature +0% ", text), text
    unsaid = demo_result(2_200_000_000, proposed=3, draft_rounds=3)
    assert _proposer(chat, unsaid) == "draft model"
    assert "the draft model does not pay" in summary([Outcome(chat, unsaid, demo_result(2_000_000_000))])


@pytest.mark.unit
def test_the_demo_summary_keeps_the_prompt_lookups_copy_out_of_the_draft_models_verdict():
    """The default request drafts copied text from its prompt lookup (the hybrid lookup): a copy that pays
    that way is what pays, labelled so, and the draft model's own verdict is taken from the requests it
    drafted alone."""
    from specserve.launch.demo import SCENARIOS, Outcome, summary

    chat, _, copy = SCENARIOS
    assert chat.proposer is None and copy.proposer is None, "the demo shows the default request"
    copied = demo_result(1_000_000_000, rounds=12, proposed=40, accepted=30, lookup=True)
    outcomes = [
        Outcome(chat, demo_result(2_000_000_000, rounds=12, proposed=1, draft_rounds=1), demo_result(2_000_000_000)),
        Outcome(copy, copied, demo_result(2_000_000_000, rounds=12)),
    ]
    text = summary(outcomes)
    assert "the draft model does not pay: at best 1.00x" in text
    assert "What pays here, against gamma 0 through this service: output that repeats its input (2.00x)." in text
    assert re.search(r"output that repeats its input +model \+ lookup +75% ", text), text
    assert re.search(r"a chat answer +model +0% ", text), text
    assert "of which from the prompt lookup: proposed 40, accepted 30" in copied.stats.summary()


@pytest.mark.unit
def test_request_flags_reach_the_sdk_including_the_draft_length_threshold():
    """``--min-confidence`` (dynamic draft length) and the other speculation flags become SDK arguments; unset,
    the threshold is left to the server."""
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--gamma", "3", "--min-confidence", "0.3", "--no-hybrid-lookup"])
    params = cli._request_params(args)
    assert params.gamma == 3 and params.min_confidence == pytest.approx(0.3)
    assert params.hybrid_lookup is False
    assert cli._request_params(parser.parse_args(["generate", "hi"])).min_confidence is None
