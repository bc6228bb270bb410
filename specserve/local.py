"""All three roles in this process, on loopback: for ``specserve up``, the benchmark and tests.

:func:`start_local_stack` starts ``n_targets`` target replicas, one draft
replica (unless ``draft_model`` is None) and a coordinator pointed at them,
each a real gRPC server on ``host`` (port 0 = free ports; the coordinator's
port is ``port``), all sharing the Redis at ``redis_url``. Each role is started
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import SecretStr

from specserve.config import CoordinatorSettings, DraftSettings, TargetSettings

log = structlog.get_logger(__name__)


@dataclass
class LocalStack:
    """Running targets, draft and coordinator of one process; see the module docstring."""

    host: str
    coordinator: Any  # coordinator.server.CoordinatorApp
    targets: list[Any]  # target_service.server.TargetApp, one per replica
    draft: Any | None  # draft_service.server.DraftApp, or None without a draft
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
) -> LocalStack:
    """Start targets, draft and coordinator in this process; see the module docstring.

    ``target_model`` / ``draft_model`` are local Hugging Face directories (None:
    the embedded demo pair). ``with_draft=False`` runs no draft (every round is
    gamma = 0). ``*_overrides`` are extra settings fields of each role, e.g.
    ``coordinator_overrides={"max_batch_wait_ms": 1.0}``.
    """
    from coordinator.server import start_coordinator
    from target_service.server import start_target

    if n_targets < 1:
        raise ValueError(f"n_targets must be >= 1, got {n_targets}")
    common = {"host": host, "redis_url": SecretStr(redis_url)}
    worker = {**common, "port": 0, "device": device, "dtype": dtype}
    targets: list[Any] = []
    draft: Any | None = None
    try:
        for _ in range(n_targets):
            settings = TargetSettings(**{**worker, "model": target_model, **(target_overrides or {})})
            targets.append(await start_target(settings))
        if with_draft:
            from draft_service.server import start_draft

            settings = DraftSettings(**{**worker, "model": draft_model, **(draft_overrides or {})})
            draft = await start_draft(settings)
        coordinator_settings = CoordinatorSettings(
            **{
                **common,
                "port": port,
                "target_endpoints": [f"{host}:{t.port}" for t in targets],
                "draft_endpoints": [f"{host}:{draft.port}"] if draft is not None else [],
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
