"""Fixtures of the target-service tests: tiny real Llama / GPT-2 target and draft models.

Redis comes from ``tests/conftest.py`` (a real redis-server on a free port).
"""

from __future__ import annotations

import pytest
import tiny_models
from target_helpers import NAN_AT

from specserve.engine.models import load_model


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def pair(request, tmp_path_factory):
    """(target, draft) LoadedModels in float32 on CPU, one pair per architecture."""
    root = tmp_path_factory.mktemp(f"target_pair_{request.param}")
    target_dir, draft_dir = tiny_models.make_tiny_pair(root, arch=request.param, seed=11)
    return (
        load_model(target_dir, device="cpu", dtype="float32"),
        load_model(draft_dir, device="cpu", dtype="float32"),
    )


@pytest.fixture
def target(pair):
    return pair[0]


@pytest.fixture
def draft(pair):
    return pair[1]


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory):
    """One Llama target, for tests that need only one architecture (the gRPC ones)."""
    target_dir, _ = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("target_llama_only"), seed=11)
    return load_model(target_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def poisoned_target(tmp_path_factory):
    """A tiny GPT-2 target whose position embedding NAN_AT is NaN: a real model giving NaN logits to every
    row of a sequence that reaches that position, and normal ones to shorter sequences."""
    import system_fixtures as sf

    from specserve.engine.models import load_model

    pair = sf.tiny_pair(tmp_path_factory, arch="gpt2")
    out = sf.poisoned_copy(pair.target_dir, tmp_path_factory.mktemp("poisoned-verifier") / "target", position=NAN_AT)
    return load_model(out, device="cpu", dtype="float32")
