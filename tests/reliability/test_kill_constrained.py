"""``kill -9`` of a target replica during constrained streams (docs/design.md, "Constrained decoding").

Two target processes and one draft process (``specserve serve``, forked from the pre-imported launcher;
tiny float32 Llama pair, the session's real Redis); the coordinator runs in the test process. Eight greedy
streams under constraints (four under a JSON schema with long keys, four under a regex), drafting with the
model (gamma 2) and from the forced text; once each has a few tokens, the target replica holding most of
them is killed with SIGKILL. The sessions move to the other replica, which has never seen them and
rebuilds each matcher from the committed log. Every stream must equal its committed log, equal target-alone
constrained decoding (``generate()`` with the engine's logits processor), and satisfy its constraint.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
import system_fixtures as sf
from reliability_helpers import (
    Stream,
    assert_stream_is_log,
    role_starter,
    start_test_coordinator,
    two_targets_and_a_draft,
)
from waiting import wait_until

from specserve.api.constraints import Constraint
from specserve.engine.grammar import GrammarEngine
from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

EOS = 0
MAX_NEW = 96
RPC_TIMEOUT_S = 3.0
TEXTS = ("class Point:\n    def", "for i in range(", "def add(a, b):", "import os\nimport")
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 6},
        "shipping_address_line": {"type": "string", "maxLength": 8},
        "order_identifier": {"type": "integer", "minimum": 0, "maximum": 9999},
        "is_priority_shipping": {"type": "boolean"},
        "line_item_quantities": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": [
        "customer_full_name",
        "shipping_address_line",
        "order_identifier",
        "is_priority_shipping",
        "line_item_quantities",
    ],
    "additionalProperties": False,
}
JSON = Constraint("json_schema", json.dumps(SCHEMA))
REGEX = Constraint("regex", r"(def|class) [a-z]{1,12}\((a|b|self)?(, [a-z]{1,6}){0,4}\):\n    return [a-z ]{1,40}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts(pair):
    return [tuple(pair.tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS]


@pytest.fixture(scope="module")
def workers(request, pair, redis_server, tmp_path_factory):
    with two_targets_and_a_draft(role_starter(request, tmp_path_factory), pair, redis_server.url) as roles:
        yield roles


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def coordinator(workers, pair, redis_server):
    app = await start_test_coordinator(
        pair.target_dir,
        redis_server.url,
        targets=[t.address for t in workers["targets"]],
        drafts=[workers["draft"].address],
        rpc_timeout_s=RPC_TIMEOUT_S,
    )
    yield app
    await app.stop(grace=1.0)


def reference(pair, prompt, constraint: Constraint) -> list[int]:
    return sf.reference_constrained(pair, prompt, constraint, MAX_NEW, eos_token_id=EOS)


def constrained(prompt, constraint: Constraint):
    req = sf.request(prompt, max_new_tokens=MAX_NEW, gamma=2)
    req.sampling.constraint.CopyFrom(constraint.to_pb())
    return req


async def test_kill_9_of_a_target_during_constrained_streams_keeps_every_output_valid_and_exact(
    coordinator, workers, store, pair, prompts
):
    address = f"127.0.0.1:{coordinator.port}"
    pool = coordinator.coordinator.pool
    cases = [(p, c) for c in (JSON, REGEX) for p in prompts]
    streams = [Stream(constrained(p, c)) for p, c in cases]
    tasks = [asyncio.create_task(s.run(address, timeout_s=150)) for s in streams]
    await wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), timeout_s=90, what="3 tokens each")
    assigned = pool.bound_targets()
    by_endpoint = {t.address: [sid for sid, ep in assigned.items() if ep == t.address] for t in workers["targets"]}
    victim = max(workers["targets"], key=lambda t: len(by_endpoint[t.address]))
    victim.kill()
    running_at_kill = {id(s) for s in streams if not s.done}
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)

    engine = GrammarEngine(pair.tokenizer, pair.tokenizer.vocab_size, [EOS])
    for (prompt, constraint), s in zip(cases, streams, strict=True):
        await assert_stream_is_log(store, s)
        assert s.tokens == reference(pair, prompt, constraint)
        engine.matcher(constraint).sync(s.tokens)  # every token inside the grammar
        if s.stats.finish_reason == common_pb2.FINISH_REASON_EOS and constraint is JSON:
            json.loads(pair.tokenizer.decode(s.tokens, skip_special_tokens=True))
    moved = [s for s in streams if s.session_id in by_endpoint[victim.address] and id(s) in running_at_kill]
    assert moved, "no constrained session was mid-generation on the killed target"
    assert pool.targets.failures(victim.address) >= 1 or not pool.targets.is_up(victim.address)
