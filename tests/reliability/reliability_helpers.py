"""Helpers for the reliability tests: roles as real subprocesses, an event loop in a thread,
streaming a Generate call while watching its progress, and the nothing-lost checks.

* :func:`start_role` runs ``python -m specserve.launch.cli serve ROLE --FLAG VALUE ...`` on a free
  127.0.0.1 port; :class:`RoleLauncher` runs the same ``specserve.launch.cli.main(["serve", ...])``
  in processes forked from one pre-imported launcher (start-up in seconds instead of a
  torch import per role); :meth:`RoleProcess.kill` is ``kill -9``;
  :func:`wait_serving` polls the standard gRPC health service until every role answers
  SERVING (or one exits, whose log tail is then shown).
* :func:`replicas` starts a number of target and draft replicas of a model pair that way (each with its own
  Prometheus port if asked: :func:`metric` reads one of its samples); :func:`restart` starts a killed role
  again on its port with its flags.
* :class:`LoopThread` runs an asyncio loop in a daemon thread, so that synchronous tests
  (hypothesis cannot drive ``async def`` tests) can host real ``grpc.aio`` servers.
* :class:`Stream` runs one Generate call and records every streamed token as it arrives,
  its closing stats, and the status it ended with.
* :func:`assert_stream_is_log` is the check of docs/design.md invariant 4: what the client
  received is exactly the committed log after the prompt, each token once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import wait_until_blocking

from specserve.launch.redis_server import free_port
from specserve.v1 import coordinator_pb2, coordinator_pb2_grpc

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Statuses a server may answer to bad input. INTERNAL and UNKNOWN mean a bug escaped.
CLEAN_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


# --------------------------------------------------------------------------- subprocess roles


@dataclass
class RoleProcess:
    """One role running as its own process (``specserve serve ROLE``)."""

    role: str
    port: int
    pid: int
    log_path: Path
    popen: subprocess.Popen | None = None  # set when this process started it (not the launcher)
    flags: Mapping[str, Any] = field(default_factory=dict)  # what it was started with (to start it again)

    @property
    def metrics_url(self) -> str:
        """Its Prometheus ``/metrics`` (the role was started with a ``metrics_port`` flag)."""
        port = self.flags.get("metrics_port")
        if not port:
            raise ValueError(f"{self.role} on {self.port} was started without a metrics_port")
        return f"http://127.0.0.1:{port}/metrics"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _wait_gone(self, timeout_s: float) -> bool:
        try:
            wait_until_blocking(lambda: not self.alive, timeout_s=timeout_s, what=f"{self.role} to exit")
        except TimeoutError:
            return False
        return True

    def kill(self) -> None:
        """``kill -9``: no drain, no goodbye."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if not self._wait_gone(30):
            raise RuntimeError(f"{self.role} (pid {self.pid}) survived SIGKILL")

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL after a few seconds."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        if not self._wait_gone(10):
            self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def serve_argv(role: str, port: int, flags: Mapping[str, Any]) -> list[str]:
    """``serve ROLE --host 127.0.0.1 --port PORT --flag value ...`` (True/False: ``--x`` / ``--no-x``)."""
    argv = ["serve", role, "--host", "127.0.0.1", "--port", str(port)]
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def _child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start_role(role: str, flags: Mapping[str, Any], *, log_dir: Path, port: int | None = None) -> RoleProcess:
    """Start ``python -m specserve.launch.cli serve ROLE`` on ``port`` (default: a free loopback port) with
    ``flags`` (``{"redis_url": ..., "model": ...}``)."""
    port = port or free_port()
    args = [sys.executable, "-m", "specserve.launch.cli", *serve_argv(role, port, flags)]
    log_path = log_dir / f"{role}-{port}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=_child_env()
        )
    return RoleProcess(role=role, port=port, pid=proc.pid, log_path=log_path, popen=proc, flags=dict(flags))


def fork_roles() -> bool:
    """Whether role processes are forked from a :class:`RoleLauncher` (default) or each started
    as ``python -m specserve.launch.cli serve`` (``SPECSERVE_TEST_FORK_ROLES=0``)."""
    return os.environ.get("SPECSERVE_TEST_FORK_ROLES", "1") != "0"


class RoleLauncher:
    """Starts roles as forks of one pre-imported process (``role_zygote.py``), each running
    ``specserve.launch.cli.main(["serve", ROLE, ...])``: the same CLI path as :func:`start_role`,
    without paying the torch/transformers import once per role. Close it to end the launcher."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._stderr = open(log_dir / "launcher.log", "wb")
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("role_zygote.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=REPO_ROOT,
            env=_child_env(),
            text=True,
        )
        self._ready = False

    def _wait_ready(self) -> None:
        if not self._ready:
            line = self._proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(
                    f"the role launcher did not start: {line!r} (see {self.log_dir}/launcher.log)"
                )
            self._ready = True

    def start(self, role: str, flags: Mapping[str, Any], port: int | None = None) -> RoleProcess:
        """``serve ROLE`` on ``port`` (default: a free one; a killed role's port to restart it there)."""
        self._wait_ready()
        port = port or free_port()
        log_path = self.log_dir / f"{role}-{port}.log"
        if log_path.exists():
            log_path = self.log_dir / f"{role}-{port}-{free_port()}.log"
        request = {"argv": serve_argv(role, port, flags), "log": str(log_path)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        pid = int(self._proc.stdout.readline())
        return RoleProcess(role=role, port=port, pid=pid, log_path=log_path, flags=dict(flags))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stderr.close()


def role_starter(request: Any, tmp_path_factory: Any) -> Callable[..., RoleProcess]:
    """How a test module starts ``specserve serve`` roles: forked from the pre-imported launcher
    (``role_launcher``), or with ``SPECSERVE_TEST_FORK_ROLES=0`` as ``python -m specserve.launch.cli serve ...``."""
    if fork_roles():
        return request.getfixturevalue("role_launcher").start
    log_dir = tmp_path_factory.mktemp("role-logs")
    return lambda role, flags, port=None: start_role(role, flags, log_dir=log_dir, port=port)


@contextlib.contextmanager
def serving(roles: list[RoleProcess], *, timeout_s: float = 240) -> Iterator[list[RoleProcess]]:
    """``roles`` once every one serves; stopped on exit."""
    try:
        wait_serving(roles, timeout_s=timeout_s)
        yield roles
    finally:
        for role in roles:
            role.stop()


async def start_test_coordinator(
    tokenizer: Path, redis_url: str, *, targets: list[str], drafts: list[str], **settings: Any
) -> Any:
    """A coordinator in the test process over worker processes on loopback, keeping ended sessions' logs (the
    streams are compared with them afterwards); ``settings`` override ``CoordinatorSettings``."""
    from pydantic import SecretStr

    from specserve.coordinator.server import start_coordinator
    from specserve.runtime.config import CoordinatorSettings

    return await start_coordinator(
        CoordinatorSettings(
            host="127.0.0.1",
            port=0,
            redis_url=SecretStr(redis_url),
            target_endpoints=targets,
            draft_endpoints=drafts,
            tokenizer=tokenizer,
            **{"keep_ended_sessions_s": 600.0, **settings},
        )
    )


def worker_flags(model_dir: Path, redis_url: str, **extra: Any) -> dict[str, Any]:
    """Flags of a draft or target process: float32 on CPU (greedy identity), no warm-up."""
    return {
        "redis_url": redis_url,
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "warmup": False,
        "log_level": "warning",
        **extra,
    }


@contextlib.contextmanager
def replicas(
    start: Callable[..., RoleProcess],
    pair: Any,
    redis_url: str,
    *,
    targets: int,
    drafts: int,
    metrics: bool = False,
    **extra: Any,
) -> Iterator[dict[str, list[RoleProcess]]]:
    """``targets`` target and ``drafts`` draft replicas of ``pair`` as ``specserve serve`` processes started by
    ``start`` (:func:`role_starter`), each with ``extra`` flags and, with ``metrics``, its own Prometheus port
    (:attr:`RoleProcess.metrics_url`): ``{"targets": [...], "drafts": [...]}``, serving until the block ends, when
    the roles then in the lists are stopped (a test may put a restarted one, :func:`restart`, in its place)."""

    def flags(model_dir: Path) -> dict[str, Any]:
        return worker_flags(model_dir, redis_url, shutdown_grace_s=1, **extra) | (
            {"metrics_port": free_port()} if metrics else {}
        )

    roles = {
        "targets": [start("target", flags(pair.target_dir)) for _ in range(targets)],
        "drafts": [start("draft", flags(pair.draft_dir)) for _ in range(drafts)],
    }
    try:
        for tries_left in range(PORT_TRIES - 1, -1, -1):
            lost = _lost_their_port([*roles["targets"], *roles["drafts"]])
            for kind, role, i in lost:  # another process took a free port before the role bound it
                roles[kind][i] = start(role.role, flags(Path(role.flags["model"])))
            if not lost or not tries_left:
                break
        wait_serving([*roles["targets"], *roles["drafts"]], timeout_s=240)
        yield roles
    finally:
        for role in [*roles["targets"], *roles["drafts"]]:
            role.stop()


#: Starts of a role whose free port another process took first (the port is picked, then bound by the role).
PORT_TRIES = 3


def _lost_their_port(roles: list[RoleProcess]) -> list[tuple[str, RoleProcess, int]]:
    """Wait until every role serves or exits; the ones that exited because their port was taken, as
    ``(kind, role, index in its kind)``. Any other exit raises, with the log, as :func:`wait_serving` does."""
    try:
        wait_serving(roles, timeout_s=240)
        return []
    except RuntimeError:
        pass
    lost = []
    counts = {"target": 0, "draft": 0}
    for role in roles:
        index = counts[role.role]
        counts[role.role] += 1
        if not role.alive and "Address already in use" in role.log_tail():
            lost.append((f"{role.role}s", role, index))
    if not lost:
        wait_serving(roles, timeout_s=240)  # raises again, with the role's log
    return lost


@contextlib.contextmanager
def two_targets_and_a_draft(start: Callable[..., RoleProcess], pair: Any, redis_url: str) -> Iterator[dict[str, Any]]:
    """Two target replicas and one draft (:func:`replicas`): ``{"targets": [RoleProcess, RoleProcess], "draft":
    RoleProcess}``, serving until the block ends."""
    with replicas(start, pair, redis_url, targets=2, drafts=1) as roles:
        yield {"targets": roles["targets"], "draft": roles["drafts"][0]}


def restart(start: Callable[..., RoleProcess], role: RoleProcess) -> RoleProcess:
    """``role`` started again by ``start`` on its port with its flags (after a kill), once it serves."""
    again = start(role.role, role.flags, port=role.port)
    wait_serving([again], timeout_s=240)
    return again


def metric(role: RoleProcess, name: str, labels: Mapping[str, str]) -> float:
    """The sample ``name`` with ``labels`` on ``role``'s ``/metrics`` now (KeyError when it exports none)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(role.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == dict(labels):
                return sample.value
    raise KeyError(f"{role.role} on {role.port} exports no {name}{labels}")


def wait_serving(roles: list[RoleProcess], *, timeout_s: float) -> None:
    """Block until every role's health service says SERVING; raise with its log if one dies."""
    pending = list(roles)

    def all_serving() -> bool:
        for role in list(pending):
            if not role.alive:
                raise RuntimeError(f"{role.role} (pid {role.pid}) exited:\n{role.log_tail()}")
            if _serving(role):
                pending.remove(role)
        return not pending

    try:
        wait_until_blocking(all_serving, timeout_s=timeout_s, what="every role to serve", poll_s=0.25)
    except TimeoutError as exc:
        logs = "\n".join(r.log_tail(1500) for r in pending)
        raise TimeoutError(f"{[r.role for r in pending]} not serving after {timeout_s} s:\n{logs}") from exc


def _serving(role: RoleProcess) -> bool:
    with grpc.insecure_channel(role.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# --------------------------------------------------------------------------- a loop in a thread


class LoopThread:
    """An asyncio event loop running in a daemon thread; :meth:`run` executes a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="reliability-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout_s: float | None = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


# --------------------------------------------------------------------------- streams


@dataclass
class Stream:
    """One Generate call: tokens as they arrive, the stats, and how it ended."""

    request: coordinator_pb2.GenerateRequest
    tokens: list[int] = field(default_factory=list)
    stats: coordinator_pb2.GenerationStats | None = None
    code: grpc.StatusCode | None = None  # None while running
    details: str = ""
    after_stats: int = 0  # messages received after the stats (must stay 0)

    @property
    def done(self) -> bool:
        return self.code is not None

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    @property
    def session_id(self) -> str | None:
        return self.stats.session_id if self.stats is not None else None

    async def run(self, address: str, *, timeout_s: float = 120.0, metadata=None) -> Stream:
        async with grpc.aio.insecure_channel(address) as channel:
            call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(
                self.request, timeout=timeout_s, metadata=metadata
            )
            try:
                async for reply in call:
                    if self.stats is not None:
                        self.after_stats += 1
                    if reply.WhichOneof("event") == "chunk":
                        self.tokens.extend(reply.chunk.token_ids)
                    else:
                        self.stats = reply.stats
                self.code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                self.code, self.details = exc.code(), exc.details() or ""
            except asyncio.CancelledError:
                self.code, self.details = grpc.StatusCode.CANCELLED, "cancelled by the test"
                raise
        return self


async def assert_stream_is_log(store: Any, stream: Stream) -> tuple[int, ...]:
    """The stream finished and carried exactly the committed log after the prompt; returns it."""
    assert stream.ok, f"stream ended with {stream.code}: {stream.details}"
    assert stream.stats is not None and stream.after_stats == 0
    record = await store.load(stream.session_id)
    generated = record.generated_token_ids
    assert tuple(stream.tokens) == generated, (
        f"session {stream.session_id}: streamed {len(stream.tokens)} tokens, the log holds {len(generated)}; "
        f"first difference at {_first_difference(stream.tokens, generated)}"
    )
    assert stream.stats.completion_tokens == len(generated)
    assert record.finished, f"session {stream.session_id} streamed its stats but its log is not finished"
    return generated


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def rss_mib() -> float:
    """Resident memory of this process in MiB (Linux /proc)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")
