"""All three roles in this process: for ``specserve up``, the benchmark and tests.

Part of the launcher (with :mod:`specserve.launch.cli`): the composition root above
the roles, and one of the two modules under ``specserve/`` that import them.

:func:`start_local_stack` starts ``n_targets`` target replicas, one draft
replica (unless ``draft_model`` is None) and a coordinator pointed at them,
each a real gRPC server (port 0 = free ports; the coordinator's port is
``port``), all sharing the Redis at ``redis_url``. The coordinator listens on
``host``; the workers always listen on loopback (``127.0.0.1``), whatever
``host`` says, so only this machine reaches them. Each role is started
through its own start function, exactly as ``specserve serve <role>`` would.
:class:`LocalStack` stops them (``stop``), or one replica at a time to
exercise failover (``stop_target(i)``, ``stop_draft()``).

Example::

    stack = await start_local_stack(target_model="models/t", draft_model="models/d",
                                    redis_url="redis://127.0.0.1:6379/0")
    print(stack.address)   # 127.0.0.1:<port>: point a Client here
    await stack.stop()
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import SecretStr

from specserve.runtime.config import CoordinatorSettings, DraftSettings, TargetSettings

log = structlog.get_logger(__name__)

#: The draft process's torch threads in a stack of processes on one machine (``specserve up``, ``demo``,
#: the benchmarks): the draft and the target take turns on the same cores, and a second team of threads
#: in the draft process costs the target's passes more than it saves the draft (the benchmark's
#: figures: docs/operations.md, the paragraph on ``threads``).
COLOCATED_DRAFT_THREADS = 1

#: Where the workers of a local stack listen: loopback only.
WORKER_HOST = "127.0.0.1"


@dataclass
class LocalStack:
    """Running targets, draft and coordinator of one process; see the module docstring."""

    host: str
    coordinator: Any  # specserve.coordinator.server.CoordinatorApp
    targets: list[Any]  # specserve.target.server.TargetApp, one per replica
    draft: Any | None  # specserve.draft.server.DraftApp, or None without a draft
    _stopped_targets: set[int] = field(default_factory=set)
    _draft_stopped: bool = False

    @property
    def port(self) -> int:
        return self.coordinator.port

    @property
    def address(self) -> str:
        """``host:port`` of the coordinator (the client API)."""
        return f"{self.host}:{self.coordinator.port}"

    @property
    def target_ports(self) -> list[int]:
        return [t.port for t in self.targets]

    @property
    def draft_port(self) -> int | None:
        return None if self.draft is None else self.draft.port

    async def stop_target(self, i: int, grace: float = 0.0) -> None:
        """Stop target replica ``i`` (its port then refuses connections)."""
        if i in self._stopped_targets:
            return
        self._stopped_targets.add(i)
        await self.targets[i].stop(grace)

    async def stop_draft(self, grace: float = 0.0) -> None:
        """Stop the draft replica; sessions continue at gamma = 0."""
        if self.draft is None or self._draft_stopped:
            return
        self._draft_stopped = True
        await self.draft.stop(grace)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop the coordinator first (drains its sessions), then the workers."""
        await self.coordinator.stop(grace)
        await self.stop_draft(grace)
        for i in range(len(self.targets)):
            await self.stop_target(i, grace)

    async def __aenter__(self) -> LocalStack:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def start_local_stack(
    *,
    target_model: str | Path | None,
    draft_model: str | Path | None,
    redis_url: str,
    port: int = 0,
    n_targets: int = 1,
    host: str = "127.0.0.1",
    device: str = "auto",
    dtype: str = "auto",
    coordinator_overrides: Mapping[str, Any] | None = None,
    target_overrides: Mapping[str, Any] | None = None,
    draft_overrides: Mapping[str, Any] | None = None,
    with_draft: bool = True,
    endpoint_map: Callable[[str, str], Awaitable[str]] | None = None,
) -> LocalStack:
    """Start targets, draft and coordinator in this process; see the module docstring.

    ``target_model`` / ``draft_model`` are registered names or local Hugging
    Face directories (None: the default pair). ``with_draft=False`` runs no
    draft (every round is gamma = 0). ``*_overrides`` are extra settings fields
    of each role, e.g. ``coordinator_overrides={"max_batch_wait_ms": 1.0}``.
    ``endpoint_map(role, endpoint)`` (role ``"draft"`` or ``"target"``), when
    given, returns the address the coordinator dials instead of a started
    worker's own: a proxy that adds network latency, in the benchmark.
    """
    from specserve.coordinator.server import start_coordinator
    from specserve.target.server import start_target

    if n_targets < 1:
        raise ValueError(f"n_targets must be >= 1, got {n_targets}")
    common = {"redis_url": SecretStr(redis_url)}
    worker = {**common, "host": WORKER_HOST, "port": 0, "device": device, "dtype": dtype}
    targets: list[Any] = []
    draft: Any | None = None
    try:
        for _ in range(n_targets):
            settings = TargetSettings(**{**worker, "model": target_model, **(target_overrides or {})})
            targets.append(await start_target(settings))
        if with_draft:
            from specserve.draft.server import start_draft

            settings = DraftSettings(**{**worker, "model": draft_model, **(draft_overrides or {})})
            draft = await start_draft(settings)
        target_endpoints = [f"{WORKER_HOST}:{t.port}" for t in targets]
        draft_endpoints = [f"{WORKER_HOST}:{draft.port}"] if draft is not None else []
        if endpoint_map is not None:
            target_endpoints = [await endpoint_map("target", e) for e in target_endpoints]
            draft_endpoints = [await endpoint_map("draft", e) for e in draft_endpoints]
        coordinator_settings = CoordinatorSettings(
            **{
                **common,
                "host": host,
                "port": port,
                "target_endpoints": target_endpoints,
                "draft_endpoints": draft_endpoints,
                "tokenizer": target_model,
                **(coordinator_overrides or {}),
            }
        )
        coordinator = await start_coordinator(coordinator_settings)
    except BaseException:
        await asyncio.gather(
            *(t.stop(0) for t in targets),
            *([draft.stop(0)] if draft is not None else []),
            return_exceptions=True,
        )
        raise
    stack = LocalStack(host=host, coordinator=coordinator, targets=targets, draft=draft)
    log.info(
        "local_stack_started",
        address=stack.address,
        target_ports=stack.target_ports,
        draft_port=stack.draft_port,
    )
    return stack


# ------------------------------------------------------------------------------------------ one process per role


@dataclass
class ProcessStack:
    """Targets, a draft and a coordinator, each its own ``specserve serve ROLE`` process.

    The roles share no GIL: the coordinator's event loop, the draft's and the
    target's model threads each run in their own interpreter, as they do in
    production (one pod per role). ``specserve up`` and ``specserve demo`` use it.
    The workers listen on loopback and require a worker token made at random for
    the stack (``worker_token``, given to the three processes in their environment),
    so no other local process can call Verify or Propose on them directly.
    """

    host: str
    port: int
    http_port: int | None
    target_ports: list[int]
    draft_port: int | None
    processes: dict[str, asyncio.subprocess.Process]
    #: Starts one more process of the stack (its name, role and settings), in the stack's environment.
    _spawn: Callable[[str, str, Mapping[str, Any]], Awaitable[asyncio.subprocess.Process]] | None = field(
        default=None, repr=False
    )
    #: The first coordinator's settings, which :meth:`add_coordinator` starts from.
    _coordinator_settings: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def add_coordinator(
        self, overrides: Mapping[str, Any] | None = None, *, start_timeout_s: float = 300.0
    ) -> str:
        """Start one more coordinator process on the stack's workers, with the first one's settings and
        ``overrides`` (a free port of its own, no HTTP API), and return its address; :meth:`stop` stops it too."""
        from specserve.launch.redis_server import free_port

        if self._spawn is None:
            raise RuntimeError("the stack is not running")
        port = free_port()
        name = f"coordinator-{sum(n.startswith('coordinator') for n in self.processes) + 1}"
        settings = {**self._coordinator_settings, "port": port, "http_port": None, **(overrides or {})}
        proc = await self._spawn(name, "coordinator", settings)
        loopback = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        await _wait_serving(proc, name, f"{loopback}:{port}", start_timeout_s)
        return f"{self.host}:{port}"

    @property
    def http_url(self) -> str | None:
        return None if self.http_port is None else f"http://{self.host}:{self.http_port}/v1"

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the coordinator (it drains), then the workers; SIGKILL whatever outlives ``grace``."""
        coordinators = [name for name in self.processes if name.startswith("coordinator")]
        order = [*coordinators, *(name for name in self.processes if name not in coordinators)]
        for name in order:
            proc = self.processes.get(name)
            if proc is None or proc.returncode is not None:
                continue
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), grace + 5.0)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    async def __aenter__(self) -> ProcessStack:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _flags(settings: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in settings.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def _check_free(host: str, port: int, message: str) -> None:
    """Fail fast (before any model loads) when ``host:port`` cannot be bound: OSError with ``message``."""
    if not port:
        return
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(message.format(where=f"{host}:{port}", error=exc.strerror or exc)) from None


async def _wait_serving(proc: asyncio.subprocess.Process, role: str, address: str, timeout_s: float) -> None:
    """Until the gRPC health service at ``address`` says SERVING; fails if the process exits first."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"the {role} process exited with status {proc.returncode} while starting")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the {role} at {address} did not start within {timeout_s:g} s")
            await asyncio.sleep(0.2)


def _affinity(cpus: Mapping[str, Collection[int]] | None) -> dict[str, frozenset[int]]:
    """``start_process_stack``'s ``cpus``, checked: known roles, CPUs this process may use."""
    if not cpus:
        return {}
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpus= needs os.sched_setaffinity (Linux); this platform has none")
    allowed = os.sched_getaffinity(0)
    out: dict[str, frozenset[int]] = {}
    for role, chosen in cpus.items():
        if role not in ("draft", "target", "coordinator"):
            raise ValueError(f"cpus names the role {role!r}; the roles are draft, target and coordinator")
        pin = frozenset(chosen)
        if not pin or not pin <= allowed:
            raise ValueError(f"cpus[{role!r}] = {sorted(pin)}: give CPUs among {sorted(allowed)}")
        out[role] = pin
    return out


async def start_process_stack(
    *,
    target_model: str | Path | None,
    draft_model: str | Path | None,
    redis_url: str,
    port: int = 0,
    http_port: int | None = None,
    host: str = "127.0.0.1",
    device: str = "auto",
    dtype: str = "auto",
    log_level: str = "warning",
    coordinator_overrides: Mapping[str, Any] | None = None,
    target_overrides: Mapping[str, Any] | None = None,
    draft_overrides: Mapping[str, Any] | None = None,
    with_draft: bool = True,
    start_timeout_s: float = 300.0,
    endpoint_map: Callable[[str, str], Awaitable[str]] | None = None,
    cpus: Mapping[str, Collection[int]] | None = None,
) -> ProcessStack:
    """Start one ``specserve serve`` process per role on loopback ports; see :class:`ProcessStack`.

    The workers always listen on 127.0.0.1 (only the coordinator takes ``host``);
    ``port`` / ``http_port`` 0 pick free ports. Each process's log goes to this
    process's stderr at ``log_level``. ``endpoint_map(role, endpoint)``, as for
    :func:`start_local_stack`, gives the address the coordinator dials for each
    worker (a delaying proxy in front of it, for the latency benchmark).
    ``cpus`` (Linux): the CPUs a role's process, and every thread it starts, may run on, by role
    (``draft``, ``target``, ``coordinator``; a role not named runs anywhere): tiers on cores of their
    own, as on machines of their own. A thread count is not implied: give the workers ``threads``.
    """
    import sys

    from specserve.launch.redis_server import free_port

    loopback = "127.0.0.1"
    affinity = _affinity(cpus)
    _check_free(host, port, "could not listen on {where} ({error}): is another server using the port?")
    if http_port:
        _check_free(host, http_port, "could not bind the HTTP API to {where} ({error})")
    # A fresh worker token per stack, in the environment of its processes alone (never on a command line,
    # which every local user can read): the coordinator sends it, the workers refuse calls without it.
    env = {**os.environ, "SPECSERVE_REDIS_URL": redis_url, "SPECSERVE_WORKER_TOKEN": secrets.token_urlsafe(32)}
    common = {"log_level": log_level, "log_format": "console"}
    worker = {**common, "host": loopback, "device": device, "dtype": dtype}
    target_port = free_port()
    draft_port = free_port() if with_draft else None
    port = port or free_port()
    if http_port == 0:
        http_port = free_port()
    processes: dict[str, asyncio.subprocess.Process] = {}

    async def spawn(name: str, role: str, settings: Mapping[str, Any]) -> asyncio.subprocess.Process:
        args = [sys.executable, "-m", "specserve.launch.cli", "serve", role, *_flags(settings)]
        pin = affinity.get(role)
        proc = await asyncio.create_subprocess_exec(
            *args,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            # Set in the child before exec, so the interpreter and every thread it starts inherit it.
            preexec_fn=None if pin is None else (lambda: os.sched_setaffinity(0, pin)),
        )
        processes[name] = proc
        return proc

    stack = ProcessStack(
        host=host,
        port=port,
        http_port=http_port,
        target_ports=[target_port],
        draft_port=draft_port,
        processes=processes,
        _spawn=spawn,
    )
    try:
        # The draft first, then the target: the target times its verify pass as it starts
        # (specserve/target/calibration.py), which a draft loading beside it on the same cores would skew.
        if draft_port is not None:
            settings = {
                **worker,
                "port": draft_port,
                "model": draft_model,
                "threads": COLOCATED_DRAFT_THREADS,
                **(draft_overrides or {}),
            }
            await _wait_serving(
                await spawn("draft", "draft", settings), "draft", f"{loopback}:{draft_port}", start_timeout_s
            )
        settings = {**worker, "port": target_port, "model": target_model, **(target_overrides or {})}
        await _wait_serving(
            await spawn("target", "target", settings), "target", f"{loopback}:{target_port}", start_timeout_s
        )
        target_endpoints = [f"{loopback}:{target_port}"]
        draft_endpoints = [f"{loopback}:{draft_port}"] if draft_port is not None else []
        if endpoint_map is not None:
            target_endpoints = [await endpoint_map("target", e) for e in target_endpoints]
            draft_endpoints = [await endpoint_map("draft", e) for e in draft_endpoints]
        coordinator = {
            **common,
            "host": host,
            "port": port,
            "http_port": http_port,
            "target_endpoints": target_endpoints,
            "draft_endpoints": draft_endpoints,
            "tokenizer": target_model,
            **(coordinator_overrides or {}),
        }
        stack._coordinator_settings = coordinator
        proc = await spawn("coordinator", "coordinator", coordinator)
        await _wait_serving(
            proc, "coordinator", f"{loopback if host in ('0.0.0.0', '::') else host}:{port}", start_timeout_s
        )
    except BaseException:
        await stack.stop(grace=0.0)
        raise
    log.info("process_stack_started", address=stack.address, pids={r: p.pid for r, p in processes.items()})
    return stack
