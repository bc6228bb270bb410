"""target_service.batching: one padded pass over ragged sessions equals each session run alone (float32)."""

from __future__ import annotations

import torch
from target_helpers import fresh_kv, fresh_logits

from target_service import batching

ATOL = 1e-5


def test_padded_pass_equals_each_row_alone(target):
    """Rows with no past, short and long pasts, and inputs of 1..6 tokens: logits and new KV per row match a
    fresh prefill of that row's whole sequence."""
    gen = torch.Generator().manual_seed(0)
    specs = [(0, 3), (7, 1), (12, 6), (2, 4)]  # (past_len, input_len)
    needed = [None, 1, 2, 4]  # logits wanted for the last k inputs (None: all)
    seqs = [torch.randint(0, target.vocab_size, (p + t,), generator=gen).tolist() for p, t in specs]
    rows = []
    for (past_len, _), seq, k in zip(specs, seqs, needed, strict=True):
        past = tuple(fresh_kv(target, seq[:past_len])) if past_len else None
        rows.append(
            batching.RowInput(past=past, past_len=past_len, input_ids=tuple(seq[past_len:]), logits_needed=k)
        )
    packed = batching.pack(rows, config=target.model.config, device="cpu")
    assert packed.positions_processed == sum(t for _, t in specs)
    assert packed.input_ids.shape == (4, 6) and packed.attention_mask.shape == (4, 12 + 6)
    logits, grown = batching.forward(target.model, packed)
    assert not torch.isnan(logits).any()
    assert logits.shape[1] == 6  # row 0 needs all its 3 inputs' logits: columns 0..5 are computed
    for b, ((past_len, t), seq) in enumerate(zip(specs, seqs, strict=True)):
        want = fresh_logits(target, seq)[past_len:][-(needed[b] or t) :]  # [k_b, vocab]
        torch.testing.assert_close(batching.row_logits(logits, packed, b), want, atol=ATOL, rtol=0)
        kv = batching.new_kv(grown, packed, b)
        for (k, v), (fk, fv) in zip(kv, fresh_kv(target, seq), strict=True):
            assert k.shape[2] == t
            torch.testing.assert_close(k, fk[:, :, past_len:], atol=ATOL, rtol=0)
            torch.testing.assert_close(v, fv[:, :, past_len:], atol=ATOL, rtol=0)
