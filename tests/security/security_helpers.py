"""Start the three roles one by one (as ``specserve serve ROLE`` would) with any settings.

``specserve.launch.local`` wires a stack for the common case; the security tests need
settings it does not pass (TLS on every hop, tokens, limits) and a delay proxy
in front of the target, so they start each role here through its own
``start_*`` function. Models are loaded once per test session and handed in.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr
from system_fixtures import TinyPair
from tcp_proxy import DelayProxy

from specserve.engine.models import LoadedModel
from specserve.runtime.config import CoordinatorSettings, DraftSettings, TargetSettings


@dataclass
class Roles:
    """One target, one draft and a coordinator; ``proxy`` (if any) sits between coordinator and target."""

    target: Any  # specserve.target.server.TargetApp
    draft: Any  # specserve.draft.server.DraftApp
    coordinator: Any  # specserve.coordinator.server.CoordinatorApp
    proxy: DelayProxy | None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"


@contextlib.asynccontextmanager
async def running_roles(
    pair: TinyPair,
    models: tuple[LoadedModel, LoadedModel],
    redis_url: str,
    *,
    worker: Mapping[str, Any] | None = None,
    coordinator: Mapping[str, Any] | None = None,
    proxy_target: bool = False,
) -> AsyncIterator[Roles]:
    """Start target, draft (``worker`` settings on both) and coordinator; stop them on exit."""
    from specserve.coordinator.server import start_coordinator
    from specserve.draft.server import start_draft
    from specserve.target.server import start_target

    common = {"host": "127.0.0.1", "port": 0, "redis_url": SecretStr(redis_url)}
    worker_kw = {**common, "device": "cpu", "dtype": "float32", "warmup": False, **(worker or {})}
    target_model, draft_model = models
    target = await start_target(TargetSettings(model=pair.target_dir, **worker_kw), model=target_model)
    draft = proxy = app = None
    try:
        draft = await start_draft(DraftSettings(model=pair.draft_dir, **worker_kw), model=draft_model)
        target_address = f"127.0.0.1:{target.port}"
        if proxy_target:
            proxy = await DelayProxy("127.0.0.1", target.port).start()
            target_address = proxy.address
        settings = CoordinatorSettings(
            **{
                **common,
                "target_endpoints": [target_address],
                "draft_endpoints": [f"127.0.0.1:{draft.port}"],
                "tokenizer": pair.target_dir,
                "rpc_timeout_s": 10.0,
                **(coordinator or {}),
            }
        )
        app = await start_coordinator(settings)
        yield Roles(target=target, draft=draft, coordinator=app, proxy=proxy)
    finally:
        if app is not None:
            await app.stop(0.5)
        if proxy is not None:
            await proxy.stop()
        if draft is not None:
            await draft.stop(0)
        await target.stop(0)


@contextlib.asynccontextmanager
async def extra_coordinator(roles: Roles, pair: TinyPair, **settings: Any) -> AsyncIterator[Any]:
    """Another coordinator (gRPC, and HTTP with ``http_port=0``) on ``roles``' workers, with its own settings."""
    from specserve.coordinator.server import start_coordinator

    base = roles.coordinator.settings
    app = await start_coordinator(
        CoordinatorSettings(
            **{
                "host": "127.0.0.1",
                "port": 0,
                "redis_url": base.redis_url,
                "target_endpoints": base.target_endpoints,
                "draft_endpoints": base.draft_endpoints,
                "tokenizer": pair.target_dir,
                "rpc_timeout_s": 10.0,
                **settings,
            }
        )
    )
    try:
        yield app
    finally:
        await app.stop(0.5)
