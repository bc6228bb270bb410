"""The deployment's routing assumption, checked against the real coordinator.

The manifests give the coordinator one endpoint per *possible* worker replica
(StatefulSet ordinals 0 .. the HPA's maxReplicas - 1), so scaling within the
HPA's bounds needs no configuration change. That works only if endpoints whose
pod does not exist (their DNS name does not resolve) are skipped: sessions
whose hash-ring home is such an endpoint must fail over to a live replica and
produce exactly the output they would have produced anyway.

Here: one real target and one real draft on loopback, listed first, followed by
three names that cannot resolve (the ``.invalid`` top-level domain is reserved
for that), as a StatefulSet scaled to 1 of at most 4 looks from the
coordinator. Several sessions (so that some hash to the missing replicas) must
all finish with the target's own greedy output.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
import system_fixtures as sf
from pydantic import SecretStr

from specserve.runtime.config import CoordinatorSettings, DraftSettings, TargetSettings

pytestmark = pytest.mark.asyncio(loop_scope="module")

MISSING_TARGETS = [f"target-{i}.target-headless.specserve.invalid:50052" for i in (1, 2, 3)]
MISSING_DRAFTS = [f"draft-{i}.draft-headless.specserve.invalid:50053" for i in (1, 2, 3)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def partly_scaled_stack(redis_server, tmp_path_factory):
    from specserve.coordinator.server import start_coordinator
    from specserve.draft.server import start_draft
    from specserve.target.server import start_target

    pair = sf.tiny_pair(tmp_path_factory)
    worker = {
        "host": "127.0.0.1",
        "port": 0,
        "redis_url": SecretStr(redis_server.url),
        "device": "cpu",
        "dtype": "float32",
        "warmup": False,
    }
    target = await start_target(TargetSettings(**worker, model=pair.target_dir))
    draft = await start_draft(DraftSettings(**worker, model=pair.draft_dir))
    coordinator = await start_coordinator(
        CoordinatorSettings(
            host="127.0.0.1",
            port=0,
            redis_url=SecretStr(redis_server.url),
            target_endpoints=[f"127.0.0.1:{target.running.port}", *MISSING_TARGETS],
            draft_endpoints=[f"127.0.0.1:{draft.running.port}", *MISSING_DRAFTS],
            tokenizer=pair.target_dir,
        )
    )
    try:
        yield pair, f"127.0.0.1:{coordinator.running.port}"
    finally:
        await coordinator.stop(0.5)
        await draft.stop(0.5)
        await target.stop(0.5)


def _failures(tier: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("specserve_coordinator_replica_failures_total", {"tier": tier}) or 0.0


async def test_sessions_homed_on_missing_replicas_fail_over_and_match_greedy(partly_scaled_stack):
    """8 sessions over a ring of 4 endpoints, 3 of them missing: all finish with the greedy output,
    and the missing ones were really tried (the chance that no session hashes to one is 4^-8)."""
    pair, address = partly_scaled_stack
    before = _failures("target"), _failures("draft")
    prompts = [[5 + i, 17 + 3 * i, 40 + i, 9] for i in range(8)]
    for prompt in prompts:
        out = await sf.generate(address, sf.request(prompt, max_new_tokens=12, gamma=3), timeout_s=120)
        assert out.token_ids == sf.reference_greedy(pair.target_dir, prompt, 12)
        assert out.stats is not None
    assert _failures("target") > before[0] and _failures("draft") > before[1]
