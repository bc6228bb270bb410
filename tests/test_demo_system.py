"""The shipped demo pair through the whole system (issue 5): a greedy completion of
held-out code, streamed by the coordinator from the draft and target services,
equals the target model's own ``generate(do_sample=False)`` token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import system_fixtures as sf
from transformers import AutoTokenizer

from specserve.bench.prompts import code_prompts, heldout_files

ROOT = Path(__file__).resolve().parents[1]
PAIR = sf.TinyPair(ROOT / "models" / "specserve-demo-target", ROOT / "models" / "specserve-demo-draft")


@pytest.mark.parametrize("gamma", [4, None], ids=["gamma4", "auto"])
async def test_heldout_code_completion_equals_target_generate(redis_server, gamma):
    files, listed = heldout_files(PAIR.target_dir)
    assert listed, "the demo target must name its held-out files (heldout_files.json)"
    prompt = code_prompts(files, 1, max_chars=400)[0]
    tokenizer = AutoTokenizer.from_pretrained(PAIR.target_dir, local_files_only=True)
    ids = tokenizer(prompt.text).input_ids
    expected = sf.reference_greedy(
        PAIR.target_dir, ids, 48, eos_token_id=tokenizer.eos_token_id, ignore_eos=True
    )
    async with sf.local_stack(PAIR, redis_server.url) as stack:
        out = await sf.generate(
            stack.address, sf.request(ids, max_new_tokens=48, gamma=gamma, ignore_eos=True), timeout_s=120
        )
    assert out.token_ids == expected, prompt.name
    assert out.stats.proposed_tokens > 0  # speculation really ran
    assert out.text == tokenizer.decode(expected)
