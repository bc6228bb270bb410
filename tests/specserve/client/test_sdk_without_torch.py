"""The SDK imports and runs a request where torch (and the rest of the serving stack) cannot be imported.

A subprocess installs an import hook that refuses torch, transformers, redis,
structlog, numpy, pydantic and tokenizers, then uses ``from specserve import
Client`` against a real stack running in this test process, and prints the
result as JSON. Its greedy output must equal what the SDK in this process gets.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import pytest_asyncio

from specserve import AsyncClient

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.system]

ROOT = Path(__file__).resolve().parents[3]

HIDDEN = (
    "torch",
    "transformers",
    "redis",
    "structlog",
    "numpy",
    "pydantic",
    "pydantic_settings",
    "tokenizers",
)

#: Run first in the subprocess: every import of a hidden package fails as if it were not installed.
HIDE = textwrap.dedent(
    f"""
    import sys

    HIDDEN = {HIDDEN!r}

    class HideServingStack:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
            return None

    sys.meta_path.insert(0, HideServingStack())
    for name in HIDDEN:
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{{name}} is still importable: the hook does not work")
    """
)

SCRIPT = textwrap.dedent(
    """
    import json, sys

    from specserve import Client, GenerateResult

    with Client(sys.argv[1]) as client:
        result = client.generate("def add(a, b):\\n", max_new_tokens=8, temperature=0, gamma=2)
        chunks = [list(c.token_ids) for c in client.stream("def add(a, b):\\n", max_new_tokens=8, temperature=0)]
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
    print(json.dumps({
        "token_ids": list(result.token_ids),
        "text": result.text,
        "rounds": result.stats.rounds,
        "streamed": [t for c in chunks for t in c],
        "loaded": loaded,
    }))
    """
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(redis_server, tmp_path_factory):
    import system_fixtures as sf

    async with sf.local_stack(sf.tiny_pair(tmp_path_factory), redis_server.url) as s:
        yield s


async def run_python(code: str, *args: str, cwd) -> tuple[int, str, str]:
    # The package under test (this checkout), not whichever one the environment installed.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        *args,
        cwd=cwd,  # not the repository root: nothing else of the checkout is importable
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def test_sdk_runs_a_request_without_torch(stack, tmp_path):
    code, out, err = await run_python(HIDE + SCRIPT, stack.address, cwd=tmp_path)
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["loaded"] == []

    async with AsyncClient(stack.address) as client:
        here = await client.generate("def add(a, b):\n", max_new_tokens=8, temperature=0, gamma=2)
    assert got["token_ids"] == list(here.token_ids)
    assert got["streamed"] == list(here.token_ids)
    assert got["text"] == here.text
    assert got["rounds"] >= 1


async def test_the_hook_really_hides_torch(tmp_path):
    """Guards the test above: with the hook, torch and the serving modules cannot be imported."""
    code, _out, err = await run_python(HIDE + "import torch\n", cwd=tmp_path)
    assert code != 0
    assert "No module named 'torch' (hidden by the test)" in err
    code, _out, err = await run_python(HIDE + "import specserve.core.verification\n", cwd=tmp_path)
    assert code != 0
    assert "(hidden by the test)" in err
