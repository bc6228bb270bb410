"""Fixtures of the security tests: a tiny model pair loaded once, throw-away PKI.

Redis comes from ``tests/conftest.py`` (a real redis-server on a free port);
tests that need a password-protected Redis start their own.
"""

from __future__ import annotations

import pytest
import system_fixtures as sf

from specserve.engine.models import load_model


@pytest.fixture(scope="session")
def sec_pair(tmp_path_factory):
    return sf.tiny_pair(tmp_path_factory)


@pytest.fixture(scope="session")
def sec_models(sec_pair):
    """(target, draft) LoadedModels, float32 on CPU, shared by every stack of these tests."""
    return (
        load_model(sec_pair.target_dir, device="cpu", dtype="float32"),
        load_model(sec_pair.draft_dir, device="cpu", dtype="float32"),
    )


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    from certs import make_pki

    return make_pki(tmp_path_factory.mktemp("security-pki"))
