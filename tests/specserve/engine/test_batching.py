"""specserve.engine.batching: one padded pass over ragged sessions, and the single-token steps after it, equal each
session run alone (float32, within 1e-5), on real tiny Llama and GPT-2 models."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from transformers import DynamicCache

from specserve.engine import batching
from specserve.engine.models import load_model

pytestmark = pytest.mark.unit

ATOL = 1e-5
#: float32 logits of a few units differ by a few 1e-6 between a padded pass and a fresh prefill (the
#: reduction order of the kernels, which can change with the machine's load); a bug is off by far more.
RTOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def target(request, tmp_path_factory):
    target_dir, _ = tiny_models.make_tiny_pair(
        tmp_path_factory.mktemp(f"batching_{request.param}"), arch=request.param
    )
    return load_model(target_dir, device="cpu", dtype="float32")


@torch.no_grad()
def fresh_logits(model, tokens) -> torch.Tensor:
    """``[len(tokens), vocab]`` float32 logits of a fresh prefill (no cache)."""
    return model.model(input_ids=torch.tensor([list(tokens)])).logits[0].float()


@torch.no_grad()
def fresh_kv(model, tokens) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` ``[1, heads, len(tokens), head_dim]`` of a fresh prefill."""
    cache = DynamicCache(config=model.model.config)
    model.model(input_ids=torch.tensor([list(tokens)]), cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _rows(target, specs, needed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, target.vocab_size, (p + t,), generator=gen).tolist() for p, t in specs]
    rows = []
    for (past_len, _), seq, k in zip(specs, seqs, needed, strict=True):
        past = tuple(fresh_kv(target, seq[:past_len])) if past_len else None
        rows.append(
            batching.RowInput(past=past, past_len=past_len, input_ids=tuple(seq[past_len:]), logits_needed=k)
        )
    return seqs, rows


def test_padded_pass_equals_each_row_alone(target):
    """Rows with no past, short and long pasts, and inputs of 1..6 tokens: logits and new KV per row match a
    fresh prefill of that row's whole sequence."""
    specs = [(0, 3), (7, 1), (12, 6), (2, 4)]  # (past_len, input_len)
    needed = [None, 1, 2, 4]  # logits wanted for the last k inputs (None: all)
    seqs, rows = _rows(target, specs, needed)
    packed = batching.pack(rows, config=target.model.config, device="cpu")
    assert packed.positions_processed == sum(t for _, t in specs)
    assert packed.input_ids.shape == (4, 6) and packed.attention_mask.shape == (4, 12 + 6)
    logits, grown = batching.forward(target.model, packed)
    assert not torch.isnan(logits).any()
    assert logits.shape[1] == 6  # row 0 needs all its 3 inputs' logits: columns 0..5 are computed
    last = batching.last_logits(logits, packed)  # [4, vocab]: ragged rows end in different columns
    for b, ((past_len, t), seq) in enumerate(zip(specs, seqs, strict=True)):
        want = fresh_logits(target, seq)[past_len:][-(needed[b] or t) :]  # [k_b, vocab]
        torch.testing.assert_close(batching.row_logits(logits, packed, b), want, atol=ATOL, rtol=RTOL)
        assert torch.equal(last[b], batching.row_logits(logits, packed, b)[-1])
        kv = batching.new_kv(grown, packed, b)
        for (k, v), (fk, fv) in zip(kv, fresh_kv(target, seq), strict=True):
            assert k.shape[2] == t
            torch.testing.assert_close(k, fk[:, :, past_len:], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(v, fv[:, :, past_len:], atol=ATOL, rtol=RTOL)


def test_steps_after_a_ragged_pass_equal_each_row_alone(target):
    """pack(room) -> forward -> align_ends -> next_step ... : rows decode one token per step, some drop out,
    and each row's logits and its KV of everything fed equal a fresh prefill; the cache is written in place."""
    specs = [(5, 1), (0, 4), (9, 2)]
    seqs, rows = _rows(target, specs, [1, 1, 1], seed=3)
    packed = batching.pack(rows, config=target.model.config, device="cpu", room=3)
    logits, cache = batching.forward(target.model, packed)
    buffers = [layer.keys.data_ptr() for layer in cache.layers]
    packed = batching.align_ends(packed, cache)
    assert {stop for _, stop in packed.spans} == {9 + 4}
    fed = [list(seq) for seq in seqs]
    alive = [0, 1, 2]
    for step, keep in enumerate([[0, 1, 2], [0, 2], [2]]):
        last = batching.last_logits(logits, packed)  # [alive, vocab]
        for b, row in enumerate(alive):  # check this pass's logits, then feed each row its argmax
            want = fresh_logits(target, fed[row])[-1]  # [vocab]
            torch.testing.assert_close(batching.row_logits(logits, packed, b)[-1], want, atol=ATOL, rtol=RTOL)
            assert torch.equal(last[b], batching.row_logits(logits, packed, b)[-1])
        tokens = [int(batching.row_logits(logits, packed, alive.index(r))[-1].argmax()) for r in keep]
        for b, row in enumerate(alive):
            if row not in keep:  # drops out: everything it was fed since pack comes back out
                kv = batching.new_kv(cache, packed, b)
                past_len = specs[row][0]
                for (k, _), (fk, _) in zip(kv, fresh_kv(target, fed[row]), strict=True):
                    assert k.shape[2] == len(fed[row]) - past_len
                    torch.testing.assert_close(k, fk[:, :, past_len:], atol=ATOL, rtol=RTOL)
        packed = batching.next_step(packed, cache, tokens, [alive.index(r) for r in keep])
        for r, token in zip(keep, tokens, strict=True):
            fed[r].append(token)
        alive = keep
        logits, cache = batching.forward(target.model, packed)
        assert packed.positions_processed == len(keep), f"step {step}"
        in_place = [layer.keys.data_ptr() for layer in cache.layers] == buffers
        assert in_place == (step == 0)  # written into the room; rows dropping out compact the batch
    want = fresh_logits(target, fed[2])[-1]
    torch.testing.assert_close(batching.row_logits(logits, packed, 0)[-1], want, atol=ATOL, rtol=RTOL)


def test_pack_checks_its_rows(target):
    with pytest.raises(ValueError, match="at least one token"):
        batching.RowInput(past=None, past_len=0, input_ids=())
    with pytest.raises(ValueError, match="past must be given"):
        batching.RowInput(past=None, past_len=3, input_ids=(1,))
    with pytest.raises(ValueError, match="at least one row"):
        batching.pack([], config=target.model.config, device="cpu")
