"""The ``specserve`` command line.

::

    specserve demo                      # start everything, stream a completion, print the stats, stop
    specserve up [--port 50051]         # coordinator + draft + target in one process, until Ctrl-C
    specserve serve {draft,target,coordinator} [--FIELD VALUE ...]   # one role (env SPECSERVE_<FIELD>)
    specserve generate PROMPT --addr HOST:PORT [--temperature 0 ...]  # stream from a running coordinator
    specserve bench [...]               # the benchmark harness (bench/harness.py)

Imports are lazy: ``generate`` needs only grpcio and protobuf; ``up``, ``demo``
and ``serve`` load the serving stack (torch, transformers, redis) when they run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.client import GenerationStats

DEMO_PROMPT = (
    'def binary_search(items, target):\n    """Return the index of target in sorted items, or -1."""\n'
)

#: role -> (settings class in specserve.config, module with ``async serve(settings)``)
ROLES = {
    "draft": ("DraftSettings", "draft_service.server"),
    "target": ("TargetSettings", "target_service.server"),
    "coordinator": ("CoordinatorSettings", "coordinator.server"),
}


class CliError(Exception):
    """A user-facing error: printed as ``error: <message>``, exit status 2."""


# --------------------------------------------------------------------------- stats


def format_stats(stats: GenerationStats) -> str:
    """The per-request statistics as a few human-readable lines."""
    per_pos = " ".join(str(n) for n in stats.accepted_per_position) or "-"
    return "\n".join(
        [
            f"tokens {stats.completion_tokens} (prompt {stats.prompt_tokens}) | rounds {stats.rounds} "
            f"| {stats.tokens_per_round:.2f} tokens/round | finish {stats.finish_reason}",
            f"draft tokens proposed {stats.proposed_tokens}, accepted {stats.accepted_tokens} "
            f"({100 * stats.acceptance_rate:.1f}%) | accepted per position: {per_pos}",
            f"time {stats.total_s:.3f} s ({stats.tokens_per_s:.1f} tokens/s) | first token "
            f"{1e3 * stats.first_token_s:.1f} ms | draft {stats.draft_s:.3f} s | verify "
            f"{stats.verify_s:.3f} s | queue {stats.queue_s:.3f} s",
            f"session {stats.session_id} | seed {stats.seed}",
        ]
    )


# --------------------------------------------------------------------------- private redis


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_redis(redis_url: str | None) -> Iterator[str]:
    """Yield ``redis_url``, or start a throw-away ``redis-server`` on a free loopback port and yield its URL."""
    if redis_url:
        yield redis_url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise CliError(
            "redis-server is not installed (it holds the committed prefixes): install it with "
            "`sudo apt-get install redis-server`, or pass --redis-url redis://HOST:PORT/0 of a running Redis"
        )
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="specserve-redis-") as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        proc = subprocess.Popen(
            [*args, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                if proc.poll() is not None:
                    raise CliError(f"redis-server exited with status {proc.returncode} on start")
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise CliError(f"redis-server did not start on port {port} within 10 s") from None
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------- up / demo


def _resolve_models(args: argparse.Namespace) -> tuple[str, str]:
    if (args.target_model is None) != (args.draft_model is None):
        raise CliError("pass both --target-model DIR and --draft-model DIR, or neither (the demo pair)")
    from specserve.errors import FailedPrecondition
    from specserve.models import resolve_model_path

    try:
        target = resolve_model_path(args.target_model, "target")
        draft = resolve_model_path(args.draft_model, "draft")
    except FailedPrecondition as exc:
        if args.target_model is None:
            raise CliError(
                "the embedded demo model pair is missing (models/specserve-demo-target and "
                "models/specserve-demo-draft): pass --target-model DIR --draft-model DIR (local Hugging Face "
                "model directories sharing one tokenizer), or train the pair with "
                "`python scripts/train_demo_pair.py`"
            ) from None
        raise CliError(exc.message) from None
    return str(target), str(draft)


@contextlib.asynccontextmanager
async def _local_stack(args: argparse.Namespace, redis_url: str, port: int):
    from urllib.parse import urlsplit

    from specserve.local import start_local_stack
    from specserve.logs import configure_logging

    password = urlsplit(redis_url).password
    configure_logging("console", args.log_level, secrets=[password] if password else [])
    if args.log_level != "debug":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars would clutter the terminal
    target, draft = _resolve_models(args)
    try:
        stack = await start_local_stack(
            target_model=target, draft_model=draft, redis_url=redis_url, port=port, host=args.host
        )
    except (OSError, RuntimeError) as exc:
        if "bind" not in str(exc).lower():
            raise
        raise CliError(
            f"could not listen on {args.host}:{port} ({exc}): is another server using the port? "
            "Pass --port with a free port (0 picks one)"
        ) from None
    try:
        yield stack
    finally:
        await stack.stop()


def _stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (installed first, so no signal kills us half-way)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _up(args: argparse.Namespace, redis_url: str) -> None:
    stop = _stop_event()
    async with _local_stack(args, redis_url, args.port) as stack:
        print(f"specserve is serving on {stack.address} (coordinator, draft and target in this process)")
        if args.metrics_port is not None:
            from specserve.server import start_metrics_server

            bound = start_metrics_server(args.metrics_port, args.host)
            print(f"metrics: http://{args.host}:{bound}/metrics (all three roles)")
        print(f"redis: {_redis_note(args, redis_url)}")
        print(f"try: specserve generate 'def fibonacci(n):' --addr {stack.address} --temperature 0")
        print("stop with Ctrl-C", flush=True)
        await stop.wait()
        print("stopping ...", flush=True)


def _redis_note(args: argparse.Namespace, redis_url: str) -> str:
    if args.redis_url:
        from urllib.parse import urlsplit

        parts = urlsplit(redis_url)
        return f"{parts.scheme}://{parts.hostname}:{parts.port}{parts.path}"
    return f"a private redis-server at {redis_url}, stopped on exit"


def cmd_up(args: argparse.Namespace) -> int:
    _resolve_models(args)  # fail fast, before anything starts
    with private_redis(args.redis_url) as redis_url:
        asyncio.run(_up(args, redis_url))
    return 0


async def _demo(args: argparse.Namespace, redis_url: str) -> None:
    from specserve.client import AsyncClient

    gamma = _parse_gamma(args.gamma)
    print("starting the draft, the target and the coordinator ...", file=sys.stderr, flush=True)
    async with _local_stack(args, redis_url, 0) as stack, AsyncClient(stack.address) as client:
        kw = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
        sys.stdout.write(args.prompt)
        async with client.stream(args.prompt, gamma=gamma, **kw) as stream:
            async for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        spec = stream.result
        print("\n\n-- speculative decoding (draft + target) --")
        print(format_stats(spec.stats))
        if args.compare:
            alone = await client.generate(args.prompt, gamma=0, **{**kw, "seed": spec.stats.seed})
            print("\n-- the target alone (gamma = 0), same request --")
            print(format_stats(alone.stats))
            if alone.stats.tokens_per_s:
                speedup = spec.stats.tokens_per_s / alone.stats.tokens_per_s
                print(f"\nspeedup {speedup:.2f}x", end="")
            if args.temperature == 0:
                same = "identical" if alone.token_ids == spec.token_ids else "DIFFERENT"
                print(f" | greedy output {same} to the target alone", end="")
            print()


def cmd_demo(args: argparse.Namespace) -> int:
    _resolve_models(args)
    with private_redis(args.redis_url) as redis_url:
        asyncio.run(_demo(args, redis_url))
    return 0


# --------------------------------------------------------------------------- serve


def _role_parser(role: str, settings_cls: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"specserve serve {role}",
        description=f"Run the {role} service. Every flag can also be set as SPECSERVE_<FIELD> "
        "(e.g. SPECSERVE_REDIS_URL); flags win. Lists are comma-separated.",
    )
    for name, field in settings_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description or ''} [env SPECSERVE_{name.upper()}]"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=name, metavar=name.upper(), help=help_text)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    from pydantic import ValidationError

    from specserve import config
    from specserve.logs import configure_logging, settings_secrets

    class_name, module_name = ROLES[args.role]
    settings_cls = getattr(config, class_name)
    options = _role_parser(args.role, settings_cls).parse_args(args.options)
    try:
        settings = settings_cls(**{k: v for k, v in vars(options).items() if v is not None})
    except ValidationError as exc:
        raise CliError(f"invalid {args.role} settings:\n{exc}") from None
    configure_logging(settings.log_format, settings.log_level, secrets=settings_secrets(settings))
    module = importlib.import_module(module_name)
    asyncio.run(module.serve(settings))
    return 0


# --------------------------------------------------------------------------- generate


def _parse_gamma(value: str | None) -> int | str | None:
    if value is None or value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise CliError(f"--gamma must be 'auto' or an integer >= 0, got {value!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.client import Client

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    tls_files = {"root_certificates": args.ca_file, "private_key": args.key_file}
    tls_files["certificate_chain"] = args.cert_file
    client = Client(
        args.addr, timeout=args.timeout, retries=args.retries, token=args.token,
        tls=True if args.tls else None, **tls_files,
    )  # fmt: skip
    request = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
        gamma=_parse_gamma(args.gamma), proposer=args.proposer, draft_top_k=args.draft_top_k,
    )  # fmt: skip
    with client, client.stream(prompt, **request) as stream:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    stats = stream.result.stats
    if args.json:
        print(json.dumps({**asdict(stats), "acceptance_rate": stats.acceptance_rate}), file=sys.stderr)
    else:
        print(format_stats(stats), file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from bench.harness import main as bench_main

    return bench_main(args.options)


def _bench_passthrough(argv: list[str]) -> bool:
    # argparse cannot hand "--help" and leading flags to a REMAINDER, so bench is dispatched by hand.
    return bool(argv) and argv[0] == "bench"


# --------------------------------------------------------------------------- parser


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-model", metavar="DIR", help="target model directory (default: the demo pair)")
    p.add_argument("--draft-model", metavar="DIR", help="draft model directory (default: the demo pair)")
    p.add_argument("--redis-url", help="Redis to use (default: start a private redis-server)")
    p.add_argument("--host", default="127.0.0.1", help="address the coordinator listens on")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="Distributed speculative decoding over gRPC. New here? Run `specserve demo`.",
        epilog="examples:\n"
        + "\n".join(line for line in __doc__.splitlines() if line.startswith("    specserve")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run coordinator, draft and target in one process until Ctrl-C")
    up.add_argument("--port", type=int, default=50051, help="client port (0 picks a free one)")
    up.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0 picks one)")
    _add_stack_flags(up)
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser("demo", help="start everything, stream a completion of a code prompt, show stats")
    _add_stack_flags(demo)
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    demo.add_argument("--seed", type=int, default=None)
    demo.add_argument("--gamma", default="auto", help="draft tokens per round, or 'auto'")
    demo.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the target alone (gamma = 0) and show the speedup",
    )
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser(
        "serve",
        help="run one role (configuration from SPECSERVE_* environment variables and flags)",
        description="Run one role; `specserve serve ROLE --help` lists its flags.",
        add_help=False,
    )
    serve.add_argument("role", choices=sorted(ROLES))
    serve.add_argument("options", nargs=argparse.REMAINDER, help="the role's flags")
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser(
        "bench", help="benchmark speculative decoding against baselines (bench.harness)", add_help=False
    )
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the harness's flags (see --help)")
    bench.set_defaults(func=cmd_bench)

    gen = sub.add_parser("generate", help="stream a completion from a running coordinator")
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    gen.add_argument("--addr", default="127.0.0.1:50051", help="coordinator host:port")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="default: the server's")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", type=int, action="append", default=None, help="(repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--gamma", default="auto", help="draft tokens per round, or 'auto'")
    gen.add_argument("--proposer", choices=["model", "ngram"], default="model")
    gen.add_argument("--draft-top-k", type=int, default=0)
    gen.add_argument(
        "--token", default=os.environ.get("SPECSERVE_TOKEN"), help="bearer token [env SPECSERVE_TOKEN]"
    )
    gen.add_argument("--tls", action="store_true", help="use TLS with the system's trusted roots")
    gen.add_argument("--ca-file", help="PEM CA to trust (turns TLS on)")
    gen.add_argument("--cert-file", help="PEM client certificate (mutual TLS)")
    gen.add_argument("--key-file", help="PEM client key (mutual TLS)")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline of the call, seconds")
    gen.add_argument("--retries", type=int, default=3, help="retries while the coordinator is unavailable")
    gen.add_argument("--json", action="store_true", help="print the stats as one JSON line")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specserve`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _bench_passthrough(argv):
        args = argparse.Namespace(func=cmd_bench, options=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    from specserve.errors import SpecServeError

    try:
        return args.func(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SpecServeError as exc:
        print(f"error: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
