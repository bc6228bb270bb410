"""benchmarks.coupled_lists: each way of listing a coupled round's siblings is scored as its definition says.

Pairs are built by hand (no models): where p = q every list holds the target's token; one sibling is the
chain's token alone in every coupled scheme; the optimal mode accepts one draft token with probability
sum(min(p, q)); lists that only grow never hold less; and a pair where the noise decides shows its list
winning.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.coupled_lists import SCHEMES, render, score_pair, summarize

pytestmark = pytest.mark.unit


def _pair(seed: int, shift: float, vocab: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(vocab, generator=g)
    q = torch.softmax(logits, -1)
    p = torch.softmax(logits + shift * torch.randn(vocab, generator=g), -1)
    return p, q


def test_equal_distributions_always_match_in_the_coupled_lists():
    p, _ = _pair(0, 0.0)
    got = score_pair(p, p.clone(), [1, 2, 4], 200, torch.Generator().manual_seed(1))
    for scheme in SCHEMES:
        for k in (1, 2, 4):
            assert got[f"{scheme}{k}"] == pytest.approx(1.0), (scheme, k)


def test_one_sibling_is_the_chain_alone_and_optimal_accepts_sum_min():
    """K = 1: q's and the noise's ranking and GLS are all ``x = argmax(log q + G)`` against
    ``argmax(log p + G)`` on the same draws; the optimal mode accepts with probability sum(min(p, q)) (Monte
    Carlo over 4,000 draws: 5 standard errors of a Bernoulli mean at most 0.04)."""
    p, q = _pair(2, 1.0)
    got = score_pair(p, q, [1], 4000, torch.Generator().manual_seed(3))
    assert got["plain1"] == got["noise1"] == got["gls1"]
    assert 0.0 < got["noise1"] < 1.0
    assert got["optimal1"] == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.04)


def test_more_siblings_never_hold_less_in_the_lists_that_keep_the_targets_token():
    """q's and the noise's lists grow by adding tokens (the target's token does not change with K), so their
    match probability cannot fall; the optimal mode's acceptance cannot either."""
    p, q = _pair(4, 1.5)
    got = score_pair(p, q, [1, 2, 4], 500, torch.Generator().manual_seed(5))
    for scheme in ("plain", "noise", "optimal"):
        assert got[f"{scheme}1"] <= got[f"{scheme}2"] <= got[f"{scheme}4"], scheme


def test_the_noises_list_beats_qs_where_the_noise_decides():
    """q puts a third of its mass on each of three tokens and p none on the first: the target's token is the
    noise's favourite of the other two. q's list of 2 is x and q's first other token, which is the first token
    whenever x is not: it misses half the time x is the first. The noise's list of 2 is the two noisiest
    tokens, of which the target's is one (about 0.83 against 1.0)."""
    q = torch.tensor([0.34, 0.33, 0.33])
    p = torch.tensor([0.0, 0.5, 0.5])
    got = score_pair(p, q, [2], 2000, torch.Generator().manual_seed(6))
    assert got["noise2"] > got["plain2"] + 0.1


def test_summary_and_report_name_every_scheme_and_size():
    scores = [score_pair(*_pair(s, 1.0), [1, 2], 50, torch.Generator().manual_seed(s)) for s in range(4)]
    summary = summarize(scores, [1, 2])
    assert summary["pairs"] == 4
    assert summary["noise_minus_plain"]["2"]["mean"] == pytest.approx(
        sum(s["noise2"] - s["plain2"] for s in scores) / 4
    )
    data = {
        "command": "python -m benchmarks coupled-lists",
        "date_utc": "2026-12-07 00:00 UTC",
        "head": "h",
        "settings": {"temperature": 0.7, "prompts": 1, "tokens": 4, "draws": 50, "sizes": [1, 2]},
        "sets": ["chat"],
        "summary": {"chat": summary},
    }
    text = render(data)
    assert "## chat (4 pairs)" in text and "K = 2" in text
    assert text.count("\n| ") == 2 + len(SCHEMES) + 1  # header, rule, one row per scheme and the paired gain
