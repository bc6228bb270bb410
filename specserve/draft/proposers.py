"""The draft tier's proposer: the draft model, behind the short :class:`Proposer` interface.

A proposer gets a session's committed tokens ``C`` and drafts up to ``gamma``
tokens after them, returning a :class:`Drafted` (the tokens and the exact float32
vectors they were sampled from, or ``None`` for point masses). It never sees the
verifier: the target rebuilds ``q`` from the wire form with
``specserve.core.proposal.draft_probs_from_pb`` (docs/design.md, "Conventions":
the proposer and the verifier never import each other). With a tree budget
(``DraftRequest.tree``) the proposal is a draft tree: the same chain, then the
next-best tokens of the draft's own distributions along it as point-mass
siblings (:func:`draw_step` ranks them, ``specserve.core.ranked_tree`` keeps
the best; docs/design.md, "Draft trees from the draft's ranking"); the feature
head also expands the best of them (:func:`expandable`, :func:`rank_children`).

:class:`ModelProposer` is the draft model. It samples ``x_i`` from its own
logits processed exactly as the target processes its own (``SamplingParams``),
optionally truncated to ``draft_top_k``; the vector it samples from is the one
it ships (:func:`draft_distribution`). It drafts many sessions at once
(:meth:`ModelProposer.propose_batch`): one forward pass per draft step for all
of them, and a session drafted in a batch gets exactly what it gets alone (see
the class). A constrained session's draft masks ``q`` with the same grammar as the target
(:class:`~specserve.engine.grammar.SessionGrammars`, when the proposer has one): each drafted token
keeps the completion inside the grammar, so fewer proposals are rejected; the target's
own mask on ``p`` is what keeps the output exact, whatever the draft does.
The n-gram proposer (prompt lookup) needs no model and runs in the
coordinator (``specserve/coordinator/speculation/sources/ngram.py``); a draft server refuses a
Propose for it with FAILED_PRECONDITION (``specserve/draft/engine.py``).

Randomness: the token at absolute position ``j`` is drawn with
``uniform(seed, j, Purpose.DRAFT)`` (``specserve.core.rng``). In the coupled
sampling mode the model proposer instead takes ``argmax(log q + G)`` with
``G = gumbel_noise(seed, j)``, the noise the target uses for its own token at
``j``, and ships the tokens alone (no distributions); a draft with other noise
only loses acceptance (docs/design.md, "Two sampling modes").
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
import torch

from specserve.api.errors import InvalidArgument, SpecServeError
from specserve.api.params import PROPOSER_KINDS, SamplingParams
from specserve.core.features import FeatureBlock
from specserve.core.ranked_tree import CHAIN, Candidate, Key, TreeBudget, grow_tree, score_candidates
from specserve.core.rng import Purpose, gumbel_noise, uniform
from specserve.core.sampling import (
    check_distribution,
    greedy_tokens,
    gumbel_argmax,
    logits_to_probs,
    processed_logprobs,
    sample_from,
    suppress_tokens,
)
from specserve.engine import batching, row_invariant
from specserve.engine.cpu_kernels import Kernels
from specserve.engine.grammar import ConstraintMatcher, SessionGrammars, apply_masks
from specserve.engine.kvcache import SessionCache, SessionCacheStore, common_prefix_len

log = structlog.get_logger(__name__)


@dataclass(frozen=True, eq=False)
class Drafted:
    """What a proposer drafted after ``C``."""

    token_ids: tuple[int, ...]  # [nodes]: a chain's tokens, or a tree's (the chain's, then alternatives)
    probs_f32: torch.Tensor | None  # [chain, vocab] float32 wire rows of the chain's tokens; None = point masses
    sparse: bool = False  # ship the non-zero support instead of dense bytes
    prefill_tokens: int = 0  # tokens fed to catch up with C
    #: The feature head lacks the target's features from this position on (nothing drafted); None: it lacks none.
    features_needed_from: int | None = None
    #: A draft tree's parents (``specserve.core.ranked_tree``; its tokens past the chain are point masses);
    #: empty: a chain.
    parents: tuple[int, ...] = ()
    #: Passes run beyond one per chain token to expand the tree below its alternatives (one per level).
    expansion_passes: int = 0


@dataclass(frozen=True)
class DraftRequest:
    """One proposal to make: the session, its full committed tokens and the sampling settings."""

    session_id: str
    committed: tuple[int, ...]  # C, never empty
    gamma: int
    sampling: SamplingParams
    seed: int
    draft_top_k: int = 0
    stop_token_ids: frozenset[int] = (
        frozenset()
    )  # drafting ends after one of these (nothing after it commits)
    #: ``min_new_tokens`` as an absolute position: ``stop_token_ids`` are masked out of the draft's
    #: distribution for a token drafted at a position before this (0: never; :func:`draw_step`).
    stop_tokens_from: int = 0
    #: Dynamic draft length: drafting ends after a token whose probability under the draft's own
    #: distribution is below this (0: draft ``gamma`` tokens). See :meth:`ModelProposer._draft`.
    min_confidence: float = 0.0
    #: The feature proposer's input: the target's features the draft has not seen (None: none sent), and
    #: whether they start a fresh context (``specserve/draft/feature_proposer.py``).
    features: FeatureBlock | None = None
    features_reset: bool = False
    #: The session's prompt length: its constraint (``sampling.constraint``) applies to the tokens after it.
    prompt_len: int = 0
    #: How far the proposal may branch into alternatives from the draft's own ranking (``CHAIN``: not at all).
    tree: TreeBudget = CHAIN
    #: The session's prefix-cache scope: its cache attaches and shares blocks of this scope only.
    cache_scope: bytes = b""
    #: The constraint's compiled grammar, taken when the call was prepared (``SessionGrammars.prepare``,
    #: off the model thread): the proposal builds a missing matcher from it and never compiles.
    grammar: Any = field(default=None, compare=False, repr=False)


def draft_distribution(
    logits: torch.Tensor, params: SamplingParams, context, draft_top_k: int
) -> torch.Tensor:
    """The float32 vectors the draft samples from and ships: ``[N, vocab]`` -> ``[N, vocab]`` float32.

    ``logits_to_probs`` (the session's processing), then, when ``draft_top_k > 0``,
    keep the ``draft_top_k`` most likely tokens (a stable sort: on ties the lowest
    ids win) and renormalise, then cast to float32 (the wire form). The caller
    samples from ``check_distribution`` of the result, exactly what the target rebuilds.
    """
    probs = logits_to_probs(logits, params, context)  # [N, vocab] float64
    if draft_top_k > 0 and draft_top_k < probs.shape[-1]:
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices  # [N, vocab]
        keep = order[:, :draft_top_k]  # [N, k]
        truncated = torch.zeros_like(probs)  # [N, vocab]
        truncated.scatter_(-1, keep, probs.gather(-1, keep))
        probs = truncated / truncated.sum(dim=-1, keepdim=True)  # [N, vocab]
    return probs.to(torch.float32)  # [N, vocab] float32


def draw_token(
    logits: torch.Tensor, request: DraftRequest, position: int, context: Sequence[int],
    noise: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor | None, float]:
    """One draft token from the next-token logits ``[vocab]`` at absolute ``position``.

    Returns the token, the float32 vector ``[vocab]`` it was sampled from
    (shipped with the proposal), or ``None`` for greedy (a point mass) and the
    coupled mode (``argmax(log q + G)``; the target needs the tokens alone), and
    the token's probability under that vector (its confidence, which dynamic
    draft length reads; for greedy, :func:`greedy_confidence`). The vector goes through :func:`draft_distribution` and
    ``check_distribution``, exactly what the target rebuilds; the uniform is
    ``uniform(seed, position, Purpose.DRAFT)``; the coupled mode's noise ``[vocab]`` is ``noise`` where the
    caller drew it already (:func:`coupled_noise`). (A plain greedy row's token is
    the argmax of its logits, which :meth:`ModelProposer._draft` takes for every
    row of a step in one reduction instead.)
    """
    params = request.sampling
    q32 = draft_distribution(logits.unsqueeze(0), params, [context], request.draft_top_k)  # [1, vocab]
    if params.greedy:
        token = int(q32[0].argmax())
        return token, None, greedy_confidence(logits, request, context, token)
    if params.coupled:  # argmax(log q + G) with the target's noise at this position; no q is shipped
        if noise is None:
            noise = coupled_noise(request, position, q32)
        token = int(gumbel_argmax(q32, noise[None])[0])
        return token, None, float(q32[0, token])
    q = check_distribution(q32[0])  # [vocab] float64, what the target rebuilds
    token = sample_from(q, uniform(request.seed, position, Purpose.DRAFT))
    return token, q32[0], float(q[token])


def coupled_noise(request: DraftRequest, position: int, like: torch.Tensor) -> torch.Tensor:
    """``[vocab]``: the Gumbel noise the target draws its own token at ``position`` with in the coupled mode
    (``gumbel_noise(seed, position)``), on ``like``'s device, ``like`` ``[..., vocab]``."""
    return gumbel_noise([request.seed], [position], like.shape[-1], device=like.device)[0]


def greedy_confidence(logits: torch.Tensor, request: DraftRequest, context: Sequence[int], token: int) -> float:
    """A greedy row's confidence in ``token``: its probability under the processed distribution at
    temperature 1 (``processed_logprobs``: a greedy draft's one-hot would always say 1); 1 without a
    threshold to compare it with (a softmax over the vocabulary saved)."""
    if request.min_confidence <= 0.0:
        return 1.0
    return float(processed_logprobs(logits.unsqueeze(0), request.sampling, [context])[0, token].exp())


#: What a proposer gives each request of a batch: its proposal, or why it has none.
Outcome = Drafted | SpecServeError


class Proposer(abc.ABC):
    """Drafts tokens after a session's committed prefix."""

    #: The ``ProposerKind`` this class implements.
    kind: ClassVar[int]

    @abc.abstractmethod
    def propose(self, request: DraftRequest) -> Drafted:
        """Draft up to ``request.gamma`` tokens after ``request.committed``."""

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Outcome]:
        """:meth:`propose` for each request (distinct sessions), in order; a request's error is its outcome."""
        out: list[Outcome] = []
        for request in requests:
            try:
                out.append(self.propose(request))
            except SpecServeError as exc:
                out.append(exc)
        return out

    def release(self, session_id: str) -> bool:
        """Drop per-session state; ``False`` when there was none."""
        return False


class RowProposer(Proposer):
    """A proposer that drafts a batch in shared passes, one row per session: :meth:`_row` brings each session's
    state in line with its committed prefix, :meth:`_draft` drafts every row together, :meth:`_keep` settles each
    row after, :meth:`_tidy` the whole batch. A request's error is its own outcome; a failed batch drops the state
    of all its sessions (rebuilt from ``C`` next time)."""

    def propose(self, request: DraftRequest) -> Drafted:
        outcome = self.propose_batch([request])[0]
        if isinstance(outcome, SpecServeError):
            raise outcome
        return outcome

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(requests)
        rows: list[Any] = []
        for i, request in enumerate(requests):
            try:
                row = self._row(i, request)
            except SpecServeError as exc:
                outcomes[i] = exc
                continue
            if isinstance(row, Drafted):
                outcomes[i] = row
            elif row is None:
                outcomes[i] = Drafted(token_ids=(), probs_f32=None)
            else:
                rows.append(row)
        if rows:
            try:
                self._draft(rows)
            except BaseException:
                for row in rows:  # a half-written state is dropped, and rebuilt from C next time
                    self.release(row.request.session_id)
                raise
            for row in rows:
                outcomes[row.index] = row.drafted()
                self._keep(row)
        self._tidy(requests, rows)
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    @staticmethod
    def _row_input(cache: SessionCache, token_ids: tuple[int, ...]) -> batching.RowInput:
        """One row of a pass: the session's cached KV, then ``token_ids``, logits for the last."""
        past = tuple(cache.layer_kv())
        return batching.RowInput(past=past or None, past_len=cache.seq_len, input_ids=token_ids, logits_needed=1)

    def _pack(self, rows: Sequence[Any]) -> batching.PackedBatch:
        """The rows' feeds in one padded batch, with room for each row's draft steps after its feed."""
        return batching.pack(
            [self._row_input(row.cache, row.feed) for row in rows],
            config=self.config,  # type: ignore[attr-defined]
            device=self.device,  # type: ignore[attr-defined]
            room=max(row.gamma for row in rows) - 1,
        )

    @abc.abstractmethod
    def _row(self, index: int, request: DraftRequest) -> Any:
        """The request's row (None: nothing to draft; a ``Drafted``: answered without drafting)."""

    @abc.abstractmethod
    def _draft(self, rows: list[Any]) -> None:
        """Draft every row, in shared passes."""

    @abc.abstractmethod
    def _keep(self, row: Any) -> None:
        """After a drafted row: what the session's state keeps (and shares) of it."""

    @abc.abstractmethod
    def _tidy(self, requests: Sequence[DraftRequest], rows: list[Any]) -> None:
        """After the batch: bound the caches (the batch's sessions protected)."""


@dataclass(eq=False)
class _Row:
    """One session on its way through a batch (mutable bookkeeping, internal)."""

    index: int  # position in the request list
    request: DraftRequest
    cache: SessionCache
    gamma: int  # tokens wanted, capped by the context limit
    feed: tuple[int, ...]  # step 0's inputs: the committed tokens the cache lacks (at least the last one)
    prefill: int  # committed tokens fed to catch up (feed and any separate prefill)
    tokens: list[int] = field(default_factory=list)  # drafted so far
    shipped: list[torch.Tensor] = field(default_factory=list)  # each [vocab] float32, sampled sessions only
    context: list[int] = field(default_factory=list)  # C + drafted so far (the repetition penalty reads it)
    confidence: float = 1.0  # the last drafted token's probability under the draft's distribution
    matcher: ConstraintMatcher | None = None  # a constrained session's grammar state at C + drafted so far
    #: A tree's inputs (``request.tree`` branches): per drafted token its probability under the draft's ranking
    #: distribution there, and the next-best tokens there (:func:`rank_alternatives`).
    chain_probs: list[float] = field(default_factory=list)
    candidates: list[tuple[Candidate, ...]] = field(default_factory=list)
    #: Where the proposer expands candidates (EAGLE-2): the candidates below each expanded one, by its key
    #: (``grow_tree``'s ``below``); empty: the alternatives are leaves.
    below: dict[Key, tuple[Candidate, ...]] = field(default_factory=dict)
    expansion_passes: int = 0  # passes that expanded candidates (one per level the row took part in)

    def done(self) -> bool:
        return (
            len(self.tokens) >= self.gamma
            or self.tokens[-1] in self.request.stop_token_ids
            or self.confidence < self.request.min_confidence
        )

    def drafted(self) -> Drafted:
        """What the row drafted, as the proposer's result."""
        shipped = None if not self.shipped else torch.stack(self.shipped)  # [gamma, vocab] float32
        tokens: tuple[int, ...] = tuple(self.tokens)
        parents: tuple[int, ...] = ()
        if self.candidates:
            tokens, parents = grow_tree(
                self.tokens, self.chain_probs, self.candidates, self.request.tree, self.below
            )
        return Drafted(
            token_ids=tokens,
            probs_f32=shipped,
            sparse=self.request.draft_top_k > 0,
            prefill_tokens=self.prefill,
            parents=parents,
            expansion_passes=self.expansion_passes,
        )


def draw_step(rows: Sequence[_Row], last: torch.Tensor) -> list[int]:
    """One draft step for ``rows`` from their next-token logits ``last`` ``[batch, vocab]``: each row takes
    its token (a plain greedy row its argmax, any other :func:`draw_token`); returns the indices of the
    rows that go on (:meth:`_Row.done`)."""
    # min_new_tokens: a row drafting before its session's minimum has its stop tokens masked first, as
    # the target masks its own rows there (the same processing follows).
    for b, row in enumerate(rows):
        if len(row.request.committed) + len(row.tokens) < row.request.stop_tokens_from:
            last = suppress_rows(last, b, row.request.stop_token_ids)
    # A constrained row: its grammar's mask at C + drafted so far, before any processing (as the target).
    constrained = [b for b, row in enumerate(rows) if row.matcher is not None]
    if constrained:
        last = last.clone()
        for b in constrained:
            matcher = rows[b].matcher
            assert matcher is not None
            bitmask = matcher.allocate(1)
            matcher.fill_mask(bitmask, 0)
            last[b : b + 1] = apply_masks(last[b : b + 1], bitmask)
    # Every row's argmax in one reduction (a row's max does not depend on the others'): a plain greedy
    # row's token; a NaN or +inf row has none, and fails the batch as its sampling would.
    argmax = greedy_tokens(last).tolist()  # [batch]
    for b, row in enumerate(rows):
        position = len(row.request.committed) + len(row.tokens)
        # The coupled mode's noise here: the chain's token and the tree's list both follow it.
        noise = coupled_noise(row.request, position, last) if row.request.sampling.coupled else None
        if row.request.sampling.plain_greedy:
            token, q32 = argmax[b], None
            row.confidence = greedy_confidence(last[b], row.request, row.context, token)
        else:
            token, q32, row.confidence = draw_token(last[b], row.request, position, row.context, noise)
        if row.request.tree.branches and row.matcher is None:  # a constrained session's proposal is a chain
            ranked = q32 if q32 is not None else ranking_distribution(last[b], row.request, row.context)
            row.chain_probs.append(float(ranked[token]))
            row.candidates.append(rank_alternatives(ranked, token, row.request.tree.max_nodes - 1, noise))
        row.tokens.append(token)
        row.context.append(token)
        if row.matcher is not None and not row.matcher.accept(token):  # masked: only a bug gets here
            raise InvalidArgument(f"the draft drew token {token}, which its session's constraint forbids")
        if q32 is not None:
            row.shipped.append(q32)
    return [b for b, row in enumerate(rows) if not row.done()]


def expandable(row: _Row, frontier: Sequence[Key]) -> list[Key]:
    """Which of ``frontier`` (candidates not expanded yet) to expand (EAGLE-2): those among the tree's best
    ``room - 1`` candidates so far (:func:`~specserve.core.ranked_tree.score_candidates`; a child ranks after
    its parent, so below any other none could be kept), with the chain going on below their depth (a child is
    no deeper than the chain) and not a stop token (nothing after it commits); none unless their path
    probabilities together pass the budget's expansion threshold (:meth:`~specserve.core.ranked_tree.TreeBudget.
    expands`: the pass that expands them costs the round a draft pass). Best path first."""
    budget = row.request.tree
    room = budget.max_nodes - len(row.tokens)
    wanted = set(frontier)
    best = score_candidates(row.chain_probs, row.candidates, budget, row.below)[: max(0, room - 1)]
    picks = [
        (key, -score) for score, depth, key, token in best
        if key in wanted and depth < len(row.tokens) - 1 and token not in row.request.stop_token_ids
    ]  # fmt: skip
    return [key for key, _ in picks] if picks and budget.expands(sum(p for _, p in picks)) else []


def rank_children(logits: torch.Tensor, row: _Row, path: Sequence[int], depth: int) -> tuple[Candidate, ...]:
    """The candidates below a node at depth index ``depth`` whose path (tokens from depth 1) is ``path``, from the
    draft's next-token logits there ``[vocab]``: its ranking distribution (:func:`ranking_distribution`, the
    row's stop tokens masked before ``min_new_tokens`` as :func:`draw_step` masks them), the ``room - 1`` best;
    in the coupled mode by ``log q + G`` with the noise at the children's position (:func:`rank_alternatives`)."""
    request = row.request
    position = len(request.committed) + depth + 1  # the children's
    if position < request.stop_tokens_from:
        logits = suppress_tokens(logits.unsqueeze(0), request.stop_token_ids, 1)[0]
    ranked = ranking_distribution(logits, request, [*request.committed, *path])
    noise = coupled_noise(request, position, logits) if request.sampling.coupled else None
    return rank_alternatives(ranked, -1, request.tree.max_nodes - len(row.tokens) - 1, noise)


def ranking_distribution(logits: torch.Tensor, request: DraftRequest, context: Sequence[int]) -> torch.Tensor:
    """The distribution a row's alternatives are ranked by, ``[vocab]`` logits -> ``[vocab]``: the one its token
    was drawn from (:func:`draft_distribution`), or for a greedy row the processed one at temperature 1 (its
    one-hot would rank nothing), as :func:`greedy_confidence` reads it."""
    if request.sampling.greedy:
        return processed_logprobs(logits.unsqueeze(0), request.sampling, [context])[0].exp()  # [vocab]
    return draft_distribution(logits.unsqueeze(0), request.sampling, [context], request.draft_top_k)[0]  # [vocab]


def rank_alternatives(
    probs: torch.Tensor, token: int, k: int, noise: torch.Tensor | None = None
) -> tuple[Candidate, ...]:
    """The ``k`` most likely tokens of ``probs`` ``[vocab]`` other than ``token``, with their probabilities, best
    first (equal ones: the lower id first); never a token of probability 0.

    With ``noise`` ``[vocab]`` (the coupled mode's Gumbel noise at the row's position, which drew ``token`` as
    ``argmax(log q + G)``) the tokens are the next of ``log q + G`` instead, the list the target's own
    ``argmax(log p + G)`` most often falls in (Gumbel-top-k: the draft's draws without replacement, coupled to
    the target's noise; docs/design.md, "Coupled lists"). Each keeps the probability of the plain ranking's
    token of the same rank, so a tree has as many alternatives at a depth as it would have without the noise.
    """
    k = min(k, probs.shape[-1] - 1)
    if k <= 0:
        return ()
    plain = _top_other(probs, probs, token, k)
    if noise is None:
        return plain
    scores = torch.where(probs > 0, probs.double().log() + noise.double(), -torch.inf)  # [vocab]
    listed = _top_other(scores, probs, token, len(plain))
    return tuple((t, p) for (t, _), (_, p) in zip(listed, plain, strict=True))


def _top_other(scores: torch.Tensor, probs: torch.Tensor, token: int, k: int) -> tuple[Candidate, ...]:
    """The ``k`` highest ``scores`` ``[vocab]`` other than ``token`` and of ``probs`` above 0, best first (ties:
    the lower id first), each with its token's probability."""
    top = torch.topk(scores, k + 1)  # [k + 1]: a full sort of the vocabulary per row and step is not needed
    found = zip(top.values.tolist(), top.indices.tolist(), probs[top.indices].tolist(), strict=True)
    ranked = sorted(found, key=lambda vtp: (-vtp[0], vtp[1]))
    out = [(int(t), float(p)) for _, t, p in ranked if t != token and p > 0.0]
    return tuple(out[:k])


def suppress_rows(last: torch.Tensor, row: int, token_ids: frozenset[int]) -> torch.Tensor:
    """``last`` ``[batch, vocab]`` with ``token_ids`` masked in row ``row`` (a copy; the other rows as they were)."""
    out = last.clone()  # [batch, vocab]
    out[row : row + 1] = suppress_tokens(last[row : row + 1], token_ids, 1)
    return out


class ModelProposer(RowProposer):
    """The small draft model, with a KV cache per session (:class:`~specserve.engine.kvcache.SessionCacheStore`).

    :meth:`propose_batch` drafts many sessions with one forward pass per draft
    step (:mod:`specserve.engine.batching`, the packing the target verifies with):

    1. each session's cache keeps the longest common prefix of what it holds
       and ``C`` (at least the last token of ``C`` is re-fed, for its logits);
       a session missing more than ``inline_catchup_max`` tokens is prefilled
       by a pass of its own first, so one long prompt does not pad every row;
    2. step 0 feeds every session's missing tokens and samples ``x1``; each
       later step feeds every remaining session its last drafted token;
    3. a session drops out of later steps once it has its ``gamma`` tokens
       (fewer near the model's context limit, so that ``C + x1..x_gamma`` still
       fits in ``max_position_embeddings``), drafted a stop token (EOS unless
       the request ignores it, or a stop token: nothing after it can commit),
       or drafted a token with probability below ``min_confidence`` under its
       own distribution (dynamic draft length: the draft stops where it is
       unsure, the token included, as HF's ``assistant_confidence_threshold``).
       That decision reads only the tokens already drafted, never the target,
       so the proposal's length is a stopping time of the draft's own sequence
       and every proposed token is still a draw from the ``q`` it ships:
       exactness is kept (docs/design.md, "Dynamic draft length").

    Every pass is row-invariant (:mod:`specserve.engine.row_invariant`): a session's
    logits, hence its tokens and the ``q`` bytes it ships, are bit for bit
    those it gets when drafted alone, whatever else shares its batch. A plain
    greedy session's token is its row's argmax (one reduction for the step's
    rows); any other is drawn per session (:func:`draw_token`) with its own
    uniforms.

    After a proposal the session's cache holds ``C + x1..x_{gamma-1}`` (the
    branch); the next reconcile keeps whichever of those tokens were committed.
    A batch that fails drops the caches of all its sessions (they are rebuilt
    from ``C`` next time).
    """

    kind = PROPOSER_KINDS["model"]

    def __init__(
        self,
        caches: SessionCacheStore,
        *,
        inline_catchup_max: int = 32,
        kernels: Kernels = "stock",
        grammars: SessionGrammars | None = None,
    ) -> None:
        self.caches = caches
        #: Constrained sessions' matchers (None: the draft does not mask q; the target's mask keeps exactness).
        self.grammars = grammars
        self.inline_catchup_max = inline_catchup_max
        self.model = caches.model
        self.config = caches.model.config
        self.device = next(caches.model.parameters()).device
        limit = getattr(self.config.get_text_config(decoder=True), "max_position_embeddings", None)
        #: Most tokens the model can attend over; a proposal stops there (None: unknown).
        self.max_positions: int | None = int(limit) if limit else None
        row_invariant.prepare(caches.model, kernels=kernels)

    def _keep(self, row: _Row) -> None:
        if row.matcher is not None:  # the branch goes: the matcher holds C again
            row.matcher.rollback(len(row.tokens))
        self.caches.share(row.cache)  # its whole committed blocks, for the sessions after it

    def _tidy(self, requests: Sequence[DraftRequest], rows: list[_Row]) -> None:
        if rows:
            self.caches.trim(protect=[row.request.session_id for row in rows])

    def _row(self, index: int, request: DraftRequest) -> _Row | None:
        """Bring the session's cache in line with ``C``; None when there is nothing to draft."""
        committed = request.committed
        if not committed:
            raise InvalidArgument("the committed prefix is empty: a session needs at least one prompt token")
        limit = self.max_positions
        if limit is not None and len(committed) > limit:
            raise InvalidArgument(
                f"session {request.session_id!r} holds {len(committed)} tokens but the draft model handles at "
                f"most {limit} positions"
            )
        gamma = request.gamma if limit is None else max(0, min(request.gamma, limit - len(committed)))
        if gamma == 0:
            return None
        cache, _created = self.caches.get_or_create(request.session_id, scope=request.cache_scope)
        self.caches.attach(cache, committed, most=len(committed) - 1)  # a new cache starts from shared blocks
        keep = min(common_prefix_len(cache.tokens, committed), len(committed) - 1)
        cache.truncate(keep)
        cache.commit(cache.branch_len)
        missing = tuple(committed[keep:])  # [at least the last token of C]
        if len(missing) - 1 > self.inline_catchup_max:
            self._prefill(cache, missing[:-1])
            missing = missing[-1:]
        matcher = None
        constraint = request.sampling.constraint
        if constraint is not None and self.grammars is not None:
            matcher = self.grammars.at(request.session_id, constraint, committed[request.prompt_len :], request.grammar)
            if matcher.terminated:
                return None  # the grammar is complete and its end drafted: nothing may follow
        return _Row(
            index=index,
            request=request,
            cache=cache,
            gamma=gamma,
            feed=missing,
            prefill=len(committed) - keep,
            context=list(committed),
            matcher=matcher,
        )

    def _prefill(self, cache: SessionCache, token_ids: Sequence[int]) -> None:
        """Feed committed tokens through a pass of the session's own (a long catch-up)."""
        packed = batching.pack(
            [self._row_input(cache, tuple(token_ids))], config=self.config, device=self.device
        )
        _, grown = row_invariant.forward(self.model, packed)
        cache.append_kv(batching.new_kv(grown, packed, 0), token_ids)
        cache.commit(cache.branch_len)

    def _draft(self, rows: list[_Row]) -> None:
        """The draft steps of one batch; fills each row's tokens and leaves its cache at ``C + x1..x_{gamma-1}``."""
        packed = self._pack(rows)
        active = list(rows)  # active[b] is row b of the current pass
        logits, grown = row_invariant.forward(self.model, packed)
        first = True
        while True:
            going = draw_step(active, batching.last_logits(logits, packed))
            for b, row in enumerate(active):
                if b not in going:  # finished: its cache takes what it was fed (C's tail, x1..x_{k-1})
                    fed = row.feed + tuple(row.tokens[:-1])
                    row.cache.append_kv(batching.new_kv(grown, packed, b), fed)
                    row.cache.commit(len(row.feed))
            if not going:
                return
            if first:
                packed = batching.align_ends(packed, grown)
                first = False
            packed = batching.next_step(packed, grown, [active[b].tokens[-1] for b in going], going)
            active = [active[b] for b in going]
            logits, grown = row_invariant.forward(self.model, packed)

    def release(self, session_id: str) -> bool:
        if self.grammars is not None:
            self.grammars.drop(session_id)
        if session_id not in self.caches:
            return False
        self.caches.release(session_id)
        return True

