"""Which list of alternatives holds the coupled mode's token most often: the head's own (p, q) pairs.

Run::

    python -m benchmarks coupled-lists --out docs/benchmarks

In the coupled sampling mode the target's token after a node is ``y = argmax(log p + G)`` whatever the tree
(:func:`specserve.core.tree_verification.verify_tree_coupled`), so the output never depends on the list of
siblings a draft offers; only how often one of them is ``y`` does. This measures that match probability at one
position for a list of ``K`` siblings, on pairs of the target's ``p`` and the feature head's ``q`` taken along
text the target alone samples in the coupled mode (held-out chat and code, the head card's prompts; ``q``
is the distribution the head's coupled chain token is drawn from, :func:`specserve.draft.proposers.draw_token`):

* **q's ranking** (``plain``): the chain's token ``x = argmax(log q + G)``, then the ``K - 1`` likeliest other
  tokens of ``q`` (the draft's tree before the coupled list).
* **the noise's ranking** (``noise``, what the draft sends): the ``K`` largest ``log q + G``, the draft's
  draws without replacement coupled to the target's noise
  (:func:`specserve.draft.proposers.rank_alternatives`).
* **Gumbel-max list sampling** (``gls``; Rowan, Phan and Khisti, arXiv:2506.05632): ``K`` independent noise
  lists, the draft's ``k``-th token ``argmax(log q + G_k)``, the target's ``argmax(log p + max_k G_k)``. Its
  target token depends on ``K``, so a seed's text would change with the list size.
* **optimal mode** (``optimal``, for reference, a different text for the same seed): the chain's token drawn
  from ``q``, then the ``K - 1`` likeliest other tokens of ``q`` as point masses, verified by recursive
  rejection sampling without replacement (:func:`specserve.core.tree_verification.verify_tree`): the
  probability that one is accepted, exactly, over the draws of the chain's token.

Each pair is scored over ``--draws`` noise draws (the same draws for every scheme, so differences are paired);
tokens whose probability is below 1e-7 under both ``p`` and ``q`` are left out of the draws (at most 0.005 of
either's mass, and a Gumbel maximum almost never lands there), the 16 likeliest of each always kept.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.options import CoupledListsOptions
from specserve.api.params import SamplingParams
from specserve.bench import markdown as md
from specserve.bench.runner import now_utc
from specserve.core import features as wire
from specserve.core.rng import gumbel_noise
from specserve.core.sampling import gumbel_argmax, logits_to_probs
from specserve.draft.proposers import DraftRequest

SCHEMES = ("plain", "noise", "gls", "optimal")
LABELS = {
    "plain": "q's ranking (before)",
    "noise": "the noise's ranking (shipped)",
    "gls": "Gumbel-max list sampling, K lists",
    "optimal": "optimal mode, q's ranking (reference)",
}
#: Tokens below this probability under both p and q are left out of the draws.
SUPPORT_FLOOR = 1e-7


@torch.inference_mode()
def collect_pairs(proposer, features, prompt: list[int], tokens: int, params: SamplingParams, eos: int, key: str):
    """``(p, q)`` after each prefix of the coupled text the target alone samples from ``prompt``: the target's
    processed ``p`` ``[vocab]`` and the head's ``q`` ``[vocab]`` for its first draft token there."""
    seq, sent, pairs = list(prompt), 0, []
    drafting = dataclasses.replace(params, sampling_mode="optimal")  # the same q, shipped with the proposal
    for _ in range(tokens):
        with features.tap() as tap:
            logits = features.model(input_ids=torch.tensor([seq])).logits[0, -1:].float()  # [1, vocab]
        block = wire.encode(tap.rows(0, len(seq) - 1)[sent:], sent)
        sent = len(seq) - 1
        got = proposer.propose(DraftRequest(key, tuple(seq), 1, drafting, params.seed or 0, features=block))
        p = logits_to_probs(logits, params, None)[0]  # [vocab] float64
        pairs.append((p.float(), got.probs_f32[0].float()))
        noise = gumbel_noise([params.seed or 0], [len(seq)], p.shape[-1])  # [1, vocab]
        seq.append(int(gumbel_argmax(p[None], noise)[0]))
        if seq[-1] == eos:
            break
    proposer.release(key)
    return pairs


def _gumbel(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
    return -torch.log(-torch.log(u))


def score_pair(p: torch.Tensor, q: torch.Tensor, sizes: list[int], draws: int, g: torch.Generator) -> dict[str, float]:
    """Each scheme's match probability for each list size on one pair, averaged over ``draws`` noise draws."""
    keep = (p > SUPPORT_FLOOR) | (q > SUPPORT_FLOOR)
    keep[p.topk(min(16, p.shape[0])).indices] = True
    keep[q.topk(min(16, q.shape[0])).indices] = True
    p, q = p[keep].double(), q[keep].double()
    lp = torch.where(p > 0, p.log(), -torch.inf)
    lq = torch.where(q > 0, q.log(), -torch.inf)
    top = max(sizes)
    noise = _gumbel((draws, top, p.shape[0]), g)  # [draws, lists, support]
    y = (lp + noise[:, 0]).argmax(-1)  # [draws]: the target's token, one noise list
    ranked = (lq + noise[:, 0]).topk(min(top, p.shape[0]), dim=-1).indices  # [draws, K]: the noise's ranking
    x = ranked[:, 0]  # the chain's token
    order = q.topk(min(top + 1, p.shape[0])).indices  # [K + 1]: q's ranking
    residual = (p - q).clamp_min(0.0)
    residual = residual / residual.sum().clamp_min(1e-300)
    accept_x = (p[x] / q[x]).clamp(max=1.0)  # [draws]: x = argmax(log q + G) has q[x] > 0
    out = {}
    for k in sizes:
        # q's ranking: x, then the k - 1 likeliest others (the first k of the order when x is among them).
        x_in = (order[: k - 1][None] == x[:, None]).any(-1)  # [draws]
        listed = torch.where(x_in[:, None], order[:k][None], torch.cat([order[: k - 1], x.new_full((1,), -1)])[None])
        others = listed.masked_fill(listed == x[:, None], -1)  # [draws, k]: the siblings after x
        out[f"plain{k}"] = ((y == x) | (others == y[:, None]).any(-1)).double().mean().item()
        out[f"noise{k}"] = (ranked[:, :k] == y[:, None]).any(-1).double().mean().item()
        y_k = (lp + noise[:, :k].max(1).values).argmax(-1)
        drafts = (lq[None, None] + noise[:, :k]).argmax(-1)  # [draws, k]
        out[f"gls{k}"] = (drafts == y_k[:, None]).any(-1).double().mean().item()
        mass = torch.where(others >= 0, residual[others.clamp_min(0)], torch.zeros(()).double()).sum(-1)
        out[f"optimal{k}"] = (accept_x + (1 - accept_x) * mass).mean().item()
    return out


def summarize(scores: list[dict[str, float]], sizes: list[int]) -> dict:
    """Per scheme and size: the mean match probability over pairs and its standard error; the shipped list's
    paired gain over q's ranking."""
    n = len(scores)

    def mean_se(values: list[float]) -> dict[str, float]:
        se = statistics.stdev(values) / math.sqrt(n) if n > 1 else 0.0
        return {"mean": statistics.fmean(values), "se": se}

    out: dict = {"pairs": n}
    for scheme in SCHEMES:
        out[scheme] = {str(k): mean_se([s[f"{scheme}{k}"] for s in scores]) for k in sizes}
    out["noise_minus_plain"] = {str(k): mean_se([s[f"noise{k}"] - s[f"plain{k}"] for s in scores]) for k in sizes}
    return out


def render(data: dict) -> str:
    sizes = data["settings"]["sizes"]
    lines = [
        "# Coupled lists: which alternatives hold the coupled mode's token",
        "",
        f"`{data['command']}` ({data['date_utc']} UTC; head `{data['head']}`, T = {data['settings']['temperature']}, "
        f"{data['settings']['prompts']} held-out prompts per set, up to {data['settings']['tokens']} tokens each, "
        f"{data['settings']['draws']} noise draws per pair; benchmarks/coupled_lists.py says how).",
        "",
        "The probability that a list of K siblings at one position holds the target's token, mean over the "
        "(p, q) pairs (one standard error over pairs). The coupled rows share one text per seed; the optimal "
        "row is the other sampling mode, for reference.",
        "",
    ]
    for kind in data["sets"]:
        s = data["summary"][kind]
        lines += [f"## {kind} ({s['pairs']} pairs)", ""]
        header = ["list"] + [f"K = {k}" for k in sizes]
        rows = [
            [LABELS[scheme]] + [f"{s[scheme][str(k)]['mean']:.3f} ({s[scheme][str(k)]['se']:.3f})" for k in sizes]
            for scheme in SCHEMES
        ]
        rows.append(
            ["noise's over q's ranking, paired"]
            + [f"{s['noise_minus_plain'][str(k)]['mean']:+.3f} ({s['noise_minus_plain'][str(k)]['se']:.3f})" for k in sizes]
        )
        lines += [*md.table(header, rows), ""]
    return "\n".join(lines)


def write(data: dict, folder: Path) -> Path:
    """``<folder>/coupled_lists.md`` from the figures."""
    return md.write(folder, "coupled_lists", render(data))


def main(opts: CoupledListsOptions) -> int:
    """``python -m benchmarks coupled-lists``: ``<out>/coupled_lists.json`` and ``.md``, the report printed."""
    from specserve.bench.draft_card import _prompt_ids
    from specserve.bench.head_card import load_head_pair
    from specserve.prompts.chat import heldout_prompts

    pair = load_head_pair(opts.target, opts.head, opts.threads)
    tok, features, proposer, head_dir = pair.tokenizer, pair.features, pair.proposer, pair.head_dir
    g = torch.Generator().manual_seed(opts.seed)
    summary = {}
    for kind in opts.sets:
        prompts = [_prompt_ids(tok, p) for p in heldout_prompts(kind, opts.prompts)]
        scores = []
        for n, prompt in enumerate(tqdm(prompts, desc=f"{kind} prompts")):
            params = SamplingParams(temperature=opts.temperature, seed=1000 + n, sampling_mode="coupled")
            for p, q in collect_pairs(proposer, features, prompt, opts.tokens, params, tok.eos_token_id, f"{kind}-{n}"):
                scores.append(score_pair(p, q, opts.sizes, opts.draws, g))
        summary[kind] = summarize(scores, opts.sizes)
    data = {
        "command": opts.command,
        "date_utc": now_utc(),
        "head": head_dir.name,
        "settings": opts.settings(),
        "sets": list(opts.sets),
        "summary": summary,
    }
    md.write(opts.out, "coupled_lists", render(data), data)
    print(render(data))
    return 0
