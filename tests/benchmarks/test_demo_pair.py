"""The shipped default draft/target pair in ``models/`` (issue 5).

Loads both through ``AutoModelForCausalLM`` / ``AutoTokenizer`` exactly as a
user would, checks they share one vocabulary, are float16 safetensors within
the size budget, and that greedy speculative decoding with them
(draft proposes, target verifies argmax) reproduces the target's own
``generate(do_sample=False)`` on held-out code.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.demo_pair import speculative_greedy

pytestmark = pytest.mark.system

MODELS = Path(os.environ.get("SPECSERVE_DEMO_MODELS_DIR", Path(__file__).resolve().parents[2] / "models"))
TARGET = MODELS / "specserve-demo-target"
DRAFT = MODELS / "specserve-demo-draft"
BUDGET_BYTES = 40 * 1000 * 1000


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def loaded():
    # one thread: on a busy 2-core machine two OpenMP threads are several times slower
    torch.set_num_threads(1)
    # import the model and tokenizer code first: a cold import of transformers'
    # modules is not part of loading the weights
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401

    out = {}
    for name, d in (("target", TARGET), ("draft", DRAFT)):
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        out[name] = (tok, model)
    return out


def test_files_are_fp16_safetensors_within_budget():
    total = 0
    for d in (TARGET, DRAFT):
        st = d / "model.safetensors"
        assert st.is_file(), f"{st} missing"
        with safe_open(st, framework="pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert dtypes == {"F16"}, (d, dtypes)
        assert json.loads((d / "config.json").read_text())["dtype"] == "float16"
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "README.md", "heldout_files.json"):
            assert (d / name).is_file(), f"{d / name} missing"
        total += _dir_bytes(d)
    assert total <= BUDGET_BYTES, f"{total / 1e6:.1f} MB > {BUDGET_BYTES / 1e6:.0f} MB"


def test_load_fp16_and_shared_vocab(loaded):
    ttok, target = loaded["target"]
    dtok, draft = loaded["draft"]
    assert next(target.parameters()).dtype == torch.float16
    assert next(draft.parameters()).dtype == torch.float16
    assert type(target).__name__ == type(draft).__name__ == "LlamaForCausalLM"
    # one vocabulary: same size, identical token table, same special tokens
    assert len(ttok) == len(dtok) == target.config.vocab_size == draft.config.vocab_size
    assert ttok.get_vocab() == dtok.get_vocab()
    assert ttok.backend_tokenizer.to_str() == dtok.backend_tokenizer.to_str()
    eos = ttok.convert_tokens_to_ids("<|endoftext|>")
    for tok, model in ((ttok, target), (dtok, draft)):
        assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == eos
        assert model.config.eos_token_id == model.config.bos_token_id == model.config.pad_token_id == eos
        assert model.generation_config.eos_token_id == eos
    # round trip of code through the byte-level tokenizer
    code = "def f(x):\n    return {'a': x ** 2}  # é\n"
    assert ttok.decode(ttok(code, add_special_tokens=False)["input_ids"]) == code


def _heldout_prompt(tok, n_tokens: int = 64) -> list[int]:
    meta = json.loads((TARGET / "heldout_files.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in meta["files"]:
        p = stdlib / rel
        if p.is_file():
            ids = tok(p.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
            if len(ids) >= 4 * n_tokens:
                mid = len(ids) // 2
                return ids[mid: mid + n_tokens]
    pytest.fail("no held-out stdlib file found")


def test_greedy_speculative_equals_target_generate(loaded):
    tok = loaded["target"][0]
    # float32: greedy speculative output is token-identical to target-only greedy
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    prompt = _heldout_prompt(tok)
    n_new = 32
    with torch.inference_mode():
        ref = target.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n_new, do_sample=False,
        )[0, len(prompt):].tolist()
    new, stats = speculative_greedy(target, draft, prompt, n_new, gamma=4, eos_id=tok.eos_token_id)
    assert new == ref
    assert len(new) == n_new or new[-1] == tok.eos_token_id
    # the draft must actually help: some proposals accepted, fewer target passes than tokens
    assert stats["accepted"] > 0 and stats["rounds"] < len(new), stats
