"""Fixtures for the tests of ``specserve``'s shared modules (opt-in, nothing autouse)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tiny-tensor maths on one intra-op thread, then restore the setting.

    The sampler tests make thousands of calls on tensors of a few dozen
    elements; there a second intra-op thread adds only synchronisation, and on a
    loaded machine each parallel region stalls (measured here: 57 ms vs 3 ms per
    ``process_logits`` call). Opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
