"""Fixtures of the draft-service tests: tiny real Llama / GPT-2 draft models and a draft gRPC server."""

from __future__ import annotations

import pytest
import tiny_models
from draft_helpers import draft_settings

from specserve.draft.server import start_draft
from specserve.engine.models import load_model


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def draft_model(request, tmp_path_factory):
    """A draft LoadedModel in float32 on CPU, one per architecture."""
    _, draft_dir = tiny_models.make_tiny_pair(
        tmp_path_factory.mktemp(f"draft_{request.param}"), arch=request.param, seed=21
    )
    return load_model(draft_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def llama_draft(tmp_path_factory):
    """One Llama draft, for tests that need only one architecture."""
    _, draft_dir = tiny_models.make_tiny_pair(tmp_path_factory.mktemp("draft_llama_only"), seed=21)
    return load_model(draft_dir, device="cpu", dtype="float32")


@pytest.fixture
async def draft_app(draft_model):
    """A real draft gRPC server on 127.0.0.1 (free port) serving ``draft_model``."""
    app = await start_draft(draft_settings(), model=draft_model)
    yield app
    await app.stop(0)


@pytest.fixture
async def llama_app(llama_draft):
    app = await start_draft(draft_settings(), model=llama_draft)
    yield app
    await app.stop(0)
