"""specserve.bench.costs on the tiny pair: the draft step is timed both back to back and right after a target pass,
on the thread count the stack gives the draft, and the process's thread count is left as it was."""

from __future__ import annotations

import pytest
import system_fixtures as sf
import torch

from specserve.bench.costs import Costs, as_run, measure_costs, predicted_speedup
from specserve.bench.pair import load_pair

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pair = sf.tiny_pair(tmp_path_factory)
    _, target, draft = load_pair(pair.target_dir, pair.draft_dir)
    return target, draft


def test_measure_costs_times_the_draft_after_a_target_pass_on_the_stacks_threads(models, monkeypatch):
    target, draft = models
    threads = torch.get_num_threads()
    seen: list[int] = []
    step = draft.forward

    def counting_forward(*args, **kwargs):  # the thread count each draft pass runs on
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    monkeypatch.setattr(draft, "forward", counting_forward)
    costs = measure_costs(target, draft, max_k=3, repeats=4, draft_threads=1)
    assert costs.draft_threads == 1 and costs.draft_step_after_target_ms > 0
    assert costs.draft_step_ms > 0 and len(costs.verify_ms) == 3
    assert torch.get_num_threads() == threads  # restored
    # The back-to-back step runs on the process's threads, the one after a target pass on the draft's.
    assert 1 in seen and (threads == 1 or threads in seen)


def test_as_run_swaps_in_the_draft_step_after_a_target_pass():
    costs = Costs(
        target_step_ms=40.0, draft_step_ms=3.0, verify_ms=[40.0, 42.0, 44.0],
        draft_step_after_target_ms=6.0, draft_threads=1,
    )  # fmt: skip
    run = as_run(costs)
    assert run is not None and run.draft_step_ms == 6.0 and run.verify_ms == costs.verify_ms
    assert predicted_speedup(0.6, 2, run) < predicted_speedup(0.6, 2, costs)  # a dearer draft, a lower bound
    assert as_run(Costs(target_step_ms=40.0, draft_step_ms=3.0, verify_ms=[40.0])) is None  # older runs
