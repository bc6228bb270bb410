"""What every tool's run checks against the server (importable by basename: pytest puts this folder on
``sys.path``): each request again, not streamed, at temperature 0, must give the text the tool received
and the token counts it reported; and where each tool's pinned version comes from."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def pin(extra: str) -> str:
    """The requirement ``pyproject.toml``'s extra ``extra`` pins (its first entry)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return f"the {extra!r} extra of pyproject.toml"
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"][extra][0]


def command_line_tool(name: str) -> str:
    """The path of a command-line tool of the suite (``guidellm``, ``aiperf``), else skip saying how to get it.

    Looked for on ``PATH``, beside this Python, then in ``.ci/venvs/<name>/bin`` (where ``.ci/run``
    installs each, in a venv of its own: their pins would otherwise move the server's own packages).
    """
    for found in (
        shutil.which(name),
        shutil.which(name, path=str(Path(sys.executable).parent)),
        shutil.which(name, path=str(ROOT / ".ci" / "venvs" / name / "bin")),
    ):
        if found:
            return found
    requirement = pin(f"compat-{name}")
    pytest.skip(
        f"{name} is not installed: .ci/run installs it ({requirement!r}, in .ci/venvs/{name}, a venv with "
        f"--system-site-packages); or put its {name} on PATH"
    )


def library(module: str, extra: str = "compat") -> Any:
    """Import a client library of the suite, else skip saying which pin to install."""
    try:
        return __import__(module)
    except ImportError:
        pytest.skip(f"{module} is not installed: pip install -e '.[{extra}]'")


def served_again(base_url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` sent again to ``endpoint`` (``chat/completions`` or ``completions``) not streamed: the reply."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    reply = httpx.post(f"{base_url}/{endpoint}", json=plain, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def reply_text(reply: dict[str, Any]) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]
