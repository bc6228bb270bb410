"""specserve.launch.local.start_process_stack: what each role's process is started with."""

from __future__ import annotations

import os
import re

import pytest


@pytest.fixture
def pair(tmp_path):
    from tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path)


async def test_a_process_stack_runs_its_draft_on_one_thread_and_the_target_on_the_default(
    pair, redis_url, monkeypatch, capfd
):
    """The roles share this machine's cores: the draft's process gets ``threads = 1``
    (``COLOCATED_DRAFT_THREADS``), the target keeps torch's default (2 here), as each role's
    ``model_loaded`` log line reports from its model thread."""
    from specserve.launch.local import COLOCATED_DRAFT_THREADS, start_process_stack

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the roles' default (the tests' own processes run 1)
    target_dir, draft_dir = pair
    stack = await start_process_stack(
        target_model=target_dir, draft_model=draft_dir, redis_url=redis_url, log_level="info",
        target_overrides={"measure_verify_cost": False},
    )  # fmt: skip
    await stack.stop()
    loaded = re.findall(r"model_loaded .*?model=(\S+).*?threads=(\d+)", capfd.readouterr().err)
    threads = {model: int(n) for model, n in loaded}
    assert threads == {str(draft_dir): COLOCATED_DRAFT_THREADS, str(target_dir): 2}
    assert COLOCATED_DRAFT_THREADS == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to give the tiers one each")
async def test_a_process_stack_pins_each_role_to_the_cpus_it_is_given(pair, redis_url):
    """``cpus``: every thread of each role's process runs on its CPUs only (the latency benchmark's
    tiers on cores of their own); a role not named keeps every CPU."""
    from specserve.launch.local import start_process_stack

    first, second = sorted(os.sched_getaffinity(0))[:2]
    target_dir, draft_dir = pair
    stack = await start_process_stack(
        target_model=target_dir, draft_model=draft_dir, redis_url=redis_url,
        target_overrides={"measure_verify_cost": False}, cpus={"draft": {first}, "target": {second}},
    )  # fmt: skip
    try:

        def threads_cpus(role: str) -> set[frozenset[int]]:
            pid = stack.processes[role].pid
            return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}

        assert threads_cpus("draft") == {frozenset({first})}
        assert threads_cpus("target") == {frozenset({second})}
        assert threads_cpus("coordinator") == {frozenset(os.sched_getaffinity(0))}
    finally:
        await stack.stop()


@pytest.mark.parametrize(
    ("cpus", "message"),
    [
        ({"drafts": {0}}, "the roles are draft, target and coordinator"),
        ({"target": set()}, "give CPUs among"),
        ({"target": {10_000}}, "give CPUs among"),
    ],
)
async def test_a_process_stack_refuses_cpus_it_cannot_pin_before_starting_anything(cpus, message, redis_url):
    from specserve.launch.local import start_process_stack

    with pytest.raises(ValueError, match=message):
        await start_process_stack(target_model="unused", draft_model="unused", redis_url=redis_url, cpus=cpus)
