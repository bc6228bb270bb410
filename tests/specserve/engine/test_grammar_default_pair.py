"""The grammar engine on the default pair's own tokenizer (a system test: it reads the shipped draft's
tokenizer files): the forced text of a JSON schema is what the tokenizer spells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from specserve.api.constraints import Constraint
from specserve.engine.grammar import GrammarEngine, unpack

pytestmark = pytest.mark.system

SMOLLM2 = Path(__file__).resolve().parents[3] / "specserve" / "models" / "specserve-smollm2-draft"


def allowed(matcher, vocab: int) -> set[int]:
    bitmask = matcher.allocate(1)
    matcher.fill_mask(bitmask, 0)
    return set(torch.nonzero(unpack(bitmask, vocab)[0]).flatten().tolist())


def test_the_default_pairs_tokenizer_forces_json_keys():
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    engine = GrammarEngine(tokenizer, 49152, [tokenizer.eos_token_id])
    schema = {
        "type": "object",
        "properties": {"customer_full_name": {"type": "string"}},
        "required": ["customer_full_name"],
    }
    matcher = engine.matcher(Constraint("json_schema", json.dumps(schema)))
    forced = matcher.forced_text()
    assert forced == '{"customer_full_name": "'
    for t in tokenizer.encode(forced):
        assert matcher.accept(t)
    assert tokenizer.eos_token_id not in allowed(matcher, 49152)
