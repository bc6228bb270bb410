"""Coupled sampling mode across ``kill -9`` failovers: 50 seeds, each the same text with and without a failure.

Two target processes and one draft process (``specserve serve ROLE``, forked from the pre-imported launcher as
in ``test_kill.py``; tiny float32 Llama pair, the session's real Redis); the coordinator runs in the test
process so the test sees which replica serves each session.

For each of 50 seeds a coupled-mode sampled request (temperature 1, ``SAMPLING_MODE_COUPLED``, the seed fixed)
runs once with no failure, then again in a round of sessions where, once every session has streamed a few
tokens, the replica serving it is frozen (SIGSTOP, so that it is caught mid-stream), killed with SIGKILL and
started again; its sessions move to the other replica, which rebuilds them from Redis. The rounds alternate
the victim; every seed not yet caught runs in each round, and one whose session was on the other replica, or
had finished, goes to the next. Each
seed's text after the failover must equal its text with no failure, token for token, and both must be the
target's own Gumbel-max sampling with that seed (``system_fixtures.reference_coupled``); each stream equals
its committed log.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio
import system_fixtures as sf
from reliability_helpers import (
    Stream,
    assert_stream_is_log,
    replicas,
    restart,
    role_starter,
    start_test_coordinator,
)
from waiting import wait_until

from specserve.v1 import common_pb2

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(1200)]

SEEDS = 50
MAX_NEW = 40
TEXTS = ("class Point:\n    def", "for i in range(", "def add(a, b):", "import os\nimport", "the quick brown")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def prompts(pair):
    return [tuple(pair.tokenizer.encode(t, add_special_tokens=False)) for t in TEXTS]


@pytest.fixture(scope="module")
def workers(request, pair, redis_server, tmp_path_factory):
    start = role_starter(request, tmp_path_factory)
    with replicas(start, pair, redis_server.url, targets=2, drafts=1) as roles:  # stops the restarted ones too
        yield {"targets": roles["targets"], "draft": roles["drafts"][0], "start": start}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def coordinator(workers, pair, redis_server):
    app = await start_test_coordinator(
        pair.target_dir,
        redis_server.url,
        targets=[t.address for t in workers["targets"]],
        drafts=[workers["draft"].address],
        rpc_timeout_s=10.0,
    )
    yield app
    await app.stop(grace=1.0)


def coupled(prompt, seed: int):
    return sf.request(
        prompt,
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        seed=seed,
        ignore_eos=True,
        gamma=(None, 1, 2, 4)[seed % 4],  # the automatic policy or a fixed gamma: the text is the same
        sampling_mode=common_pb2.SAMPLING_MODE_COUPLED,
    )


async def test_fifty_seeds_keep_their_text_across_a_kill_9_failover(
    coordinator, workers, store, pair, prompts
):
    address = f"127.0.0.1:{coordinator.port}"
    pool = coordinator.coordinator.pool
    seeds = list(range(1000, 1000 + SEEDS))
    prompt_of = {seed: prompts[seed % len(prompts)] for seed in seeds}

    # With no failure.
    calm = [Stream(coupled(prompt_of[s], s)) for s in seeds]
    await asyncio.wait_for(asyncio.gather(*(s.run(address) for s in calm)), timeout=300)
    no_failure = {}
    for seed, s in zip(seeds, calm, strict=True):
        no_failure[seed] = list(await assert_stream_is_log(store, s))

    # Rounds with a kill -9 of the replica serving the sessions, until every seed has failed over mid-stream.
    pending = list(seeds)
    failed_over: dict[int, list[int]] = {}
    kills = 0
    while pending:
        assert kills < 12, f"seeds never caught mid-stream on the victim: {pending}"
        batch = list(pending)  # about half are on the victim each round
        streams = {seed: Stream(coupled(prompt_of[seed], seed)) for seed in batch}
        tasks = [asyncio.create_task(s.run(address, timeout_s=240)) for s in streams.values()]
        victim_index = kills % 2
        victim = workers["targets"][victim_index]
        await wait_until(
            lambda streams=streams: all(len(s.tokens) >= 3 or s.done for s in streams.values()),
            timeout_s=120,
            what="3 tokens",
        )
        os.kill(victim.pid, signal.SIGSTOP)  # its sessions stop where they are
        bound = pool.bound_targets()
        at_kill = {seed: len(s.tokens) for seed, s in streams.items()}
        victim.kill()
        kills += 1
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
        for seed, s in streams.items():
            tokens = list(await assert_stream_is_log(store, s))
            caught = bound.get(s.session_id) == victim.address and at_kill[seed] < MAX_NEW
            if caught:
                failed_over[seed] = tokens
                pending.remove(seed)
            else:
                assert tokens == no_failure[seed], seed  # no failure for this one: the same text anyway
        # The killed replica comes back on its port, as an orchestrator would restart it.
        workers["targets"][victim_index] = restart(workers["start"], victim)
    tokenizer = pair.tokenizer
    for seed in seeds:
        assert failed_over[seed] == no_failure[seed], f"seed {seed}: the failover changed the text"
        assert tokenizer.decode(failed_over[seed]) == tokenizer.decode(no_failure[seed])
        assert no_failure[seed] == sf.reference_coupled(pair.target_dir, prompt_of[seed], MAX_NEW, seed=seed)
