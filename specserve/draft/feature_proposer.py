"""The feature proposer: the feature head drafting from the target's own features.

The head (:mod:`specserve.engine.feature_head`, docs/design.md "The feature
head") reads, for every committed position but the pending last one, the
target's feature there; the coordinator relays them from the target's verdicts
with each Propose (``ProposeRequest.features``). Per session the proposer keeps:

* the head's KV cache over its **true slots** ``[s0, T)``: slot ``j`` took the
  committed token ``C[j]`` and the target's feature ``f_{j-1}``. Drafted slots
  (the head's own outputs as features) live only during a call: their KV is
  dropped when the proposal is made, so the next round feeds the accepted
  tokens' slots again, with the target's features this time;
* ``s0``, the first slot's position (1 for a session whose context starts at
  position 0; later for one rebuilt from the coordinator's window after a
  failover, which then attends over fewer slots);
* the input feature of its last true slot, to feed that slot again when a
  round brings no new committed tokens (a retried Propose).

**The prefix cache.** The head's store shares true slots between sessions as the
draft model's does (``SessionCacheStore``): a context that starts at position 0
shares its whole blocks of slots, keyed by their tokens and, for the first block,
by ``C[0]`` too (slot 1 reads position 0's feature: the cache's ``lead``). A
session the proposer holds nothing for (a new turn of a chat, a failover) first
attaches the longest chain its committed tokens start with, so only the features
after it need to travel: the next turn of a conversation sends none of its
history's.

A Propose brings the features of positions ``[start, stop)``. The proposer
needs those of ``[T - 1, n - 1)`` (``n = len(C)``): it feeds slots ``T .. n - 1``
(at least slot ``n - 1``, whose output gives the first draft token). Where they
end early (the coordinator sends features in bounded messages) or do not
continue its context, it feeds the slots it can and drafts nothing: the reply
names the first position it needs (``Drafted.features_needed_from``), and the
coordinator sends on from there. Features with ``reset`` rebuild the context:
from the prefix cache where it reaches ``start``, else a fresh context at slot
``start + 1``.

Batching and sampling are the token draft's: one row-invariant pass per draft
step for all the sessions of a call (a session gets the same tokens and ``q``
bytes alone or batched), and the same per-row drawing
(:func:`specserve.draft.proposers.draw_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
import torch
from transformers import DynamicCache

from specserve.api.errors import FailedPrecondition, InvalidArgument
from specserve.api.params import PROPOSER_KINDS
from specserve.core import features as wire
from specserve.core.ranked_tree import Key
from specserve.draft.proposers import (
    Drafted,
    DraftRequest,
    RowProposer,
    _Row,
    draw_step,
    expandable,
    rank_children,
)
from specserve.engine import batching, row_invariant
from specserve.engine.cpu_kernels import Kernels
from specserve.engine.feature_head import FeatureHead
from specserve.engine.kvcache import SessionCache, SessionCacheStore, common_prefix_len

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class _HeadRow(_Row):
    """A session on its way through a batch of the head."""

    features: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [len(feed), hidden] slot inputs
    #: A branching row's feature for each drafted token's slot (``[hidden]`` each): the head's output its
    #: logits came from, which the token's slot (and an alternative's beside it) takes as input.
    step_features: list[torch.Tensor] = field(default_factory=list)


class FeatureProposer(RowProposer):
    """Drafts with the feature head (see the module docstring)."""

    kind = PROPOSER_KINDS["feature"]
    needs_model = True

    def __init__(
        self,
        head: FeatureHead,
        caches: SessionCacheStore,
        *,
        inline_catchup_max: int = 32,
        kernels: Kernels = "stock",
        expand: bool = True,
    ) -> None:
        self.head = head
        #: Whether a tree expands below its alternatives (:meth:`_expand`; False: the alternatives are leaves).
        self.expand = expand
        self.caches = caches
        self.inline_catchup_max = inline_catchup_max
        self.config = head.model.config
        self.hidden_size = int(head.config.hidden_size)
        self.device = head.fc.weight.device
        self.max_positions: int | None = int(head.config.max_position_embeddings) or None
        self._first_slot: dict[str, int] = {}  # session -> s0
        self._last_input: dict[str, torch.Tensor] = {}  # session -> [hidden]: its last true slot's feature
        row_invariant.prepare(head.model, kernels=kernels)

    def _keep(self, row: _HeadRow) -> None:
        self._share(row.request.session_id, row.cache)

    def _tidy(self, requests: Sequence[DraftRequest], rows: list[_HeadRow]) -> None:
        self.caches.trim(protect=[r.session_id for r in requests])
        for sid in list(self._first_slot):
            if sid not in self.caches:  # evicted: its bookkeeping goes too
                self._forget(sid)

    def release(self, session_id: str) -> bool:
        held = session_id in self.caches
        if held:
            self.caches.release(session_id)
        self._forget(session_id)
        return held

    def holds(self, session_id: str) -> bool:
        """Whether the head holds a context for the session."""
        return session_id in self.caches and session_id in self._first_slot

    # ---- one session --------------------------------------------------------------------

    def _forget(self, session_id: str) -> None:
        self._first_slot.pop(session_id, None)
        self._last_input.pop(session_id, None)

    def _share(self, session_id: str, cache: SessionCache) -> None:
        """The session's whole blocks of true slots into the prefix cache (a context from position 0 only:
        one rebuilt from a window attends over fewer slots, so its keys and values are its own)."""
        if self._first_slot.get(session_id) == 1:
            self.caches.share(cache)

    def _start(self, request: DraftRequest) -> None:
        """A new context for the session: the longest chain of true slots the prefix cache holds for its
        committed tokens (slots ``1 ..``) in its cache scope; with ``features_reset`` and features that start
        after that chain ends, a fresh context at slot ``features.start + 1`` instead."""
        sid, committed, block = request.session_id, request.committed, request.features
        self.release(sid)
        cache, _ = self.caches.get_or_create(sid, scope=request.cache_scope)
        cache.lead = (int(committed[0]),)  # slot 1 reads position 0's feature
        attached = self.caches.attach(cache, committed[1:], most=len(committed) - 2)
        self._first_slot[sid] = 1
        if request.features_reset and block is not None and block.start > attached:
            cache.reset()
            cache.lead = ()
            self._first_slot[sid] = block.start + 1

    def _row(self, index: int, request: DraftRequest) -> _HeadRow | Drafted | None:
        """Bring the session's head context up to ``C``; None when there is nothing to draft, a
        :class:`Drafted` naming the first position whose features are missing when they are."""
        sid, committed = request.session_id, request.committed
        n = len(committed)
        gamma = request.gamma
        if self.max_positions is not None:
            gamma = max(0, min(gamma, self.max_positions - n))
        if gamma == 0:
            return None
        block = request.features
        if block is not None and block.hidden != self.hidden_size:
            raise InvalidArgument(
                f"features have {block.hidden} values per position; this head reads {self.hidden_size}"
            )
        if n < 2:
            raise FailedPrecondition(f"session {sid!r}: the feature head drafts after at least two committed tokens")
        held = self.caches.get(sid)
        if request.features_reset or not self.holds(sid) or held is None or held.scope != request.cache_scope:
            self._start(request)  # (a context held under another cache scope is dropped first)
        cache, _ = self.caches.get_or_create(sid, scope=request.cache_scope)
        s0 = self._first_slot[sid]
        if n - 1 < s0:
            raise FailedPrecondition(
                f"session {sid!r}: features start at position {s0 - 1}, after the last committed token's "
                f"predecessor ({n - 2}); send features that end at position {n - 2}"
            )
        held = s0 + cache.seq_len  # T: true slots [s0, T)
        keep = min(common_prefix_len(cache.tokens, committed[s0:]), n - 1 - s0)
        first = s0 + keep  # the first slot fed now; it needs the feature of position first - 1
        decoded = wire.decode(block).to(self.device) if block is not None else None
        rows = []
        for p in range(first - 1, n - 1):
            if decoded is not None and block is not None and block.start <= p < block.stop:
                rows.append(decoded[p - block.start])
            elif p == held - 2 and sid in self._last_input:
                rows.append(self._last_input[sid])
            else:
                break
        cache.truncate(keep)
        cache.commit(cache.branch_len)
        if first - 1 + len(rows) < n - 1:  # features missing: feed the slots it can, draft nothing
            if rows:
                feats = torch.stack(rows).to(self.device)  # [fed, hidden]
                self._prefill(cache, tuple(committed[first : first + len(rows)]), feats)
                self._last_input[sid] = feats[-1]
                self._share(sid, cache)
            missing = first - 1 + len(rows)
            log.debug("head_needs_features", session_id=sid, position=missing, fed=len(rows))
            return Drafted(token_ids=(), probs_f32=None, prefill_tokens=len(rows), features_needed_from=missing)
        feats = torch.stack(rows).to(self.device)  # [n - first, hidden]
        feed = tuple(committed[first:])
        if len(feed) - 1 > self.inline_catchup_max:
            self._prefill(cache, feed[:-1], feats[:-1])
            feed, feats = feed[-1:], feats[-1:]
        self._last_input[sid] = feats[-1]
        return _HeadRow(
            index=index,
            request=request,
            cache=cache,
            gamma=gamma,
            feed=feed,
            prefill=n - first,
            context=list(committed),
            features=feats,
        )

    # ---- passes -------------------------------------------------------------------------

    def _pass(self, packed: batching.PackedBatch, feats: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
        """The head over ``packed``'s slots with their features ``[B, T, hidden]``: outputs ``[B, T, hidden]``."""
        cache = packed.cache if packed.cache is not None else DynamicCache(config=self.config)
        layout = row_invariant.RowLayout(spans=packed.spans, queries=packed.input_lens, trees=packed.trees)
        with torch.no_grad(), row_invariant.blocked_matmuls(self.head.model):
            hidden = self.head.hidden(
                packed.input_ids,
                feats,
                attention_mask=packed.attention_mask,
                position_ids=packed.position_ids,
                cache=cache,
                row_layout=layout,
            )
        return hidden, cache

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[batch, hidden]`` outputs -> ``[batch, vocab]`` float32 logits (``-inf`` outside the head)."""
        with torch.no_grad(), row_invariant.blocked_matmuls(self.head.model):
            return self.head.scatter(self.head.head_logits(hidden))

    def _prefill(self, cache: SessionCache, slots: tuple[int, ...], feats: torch.Tensor) -> None:
        """True slots through a pass of the session's own (a long catch-up)."""
        packed = batching.pack([self._row_input(cache, slots)], config=self.config, device=self.device)
        _, grown = self._pass(packed, feats.unsqueeze(0))
        cache.append_kv(batching.new_kv(grown, packed, 0), slots)
        cache.commit(cache.branch_len)

    def _draft(self, rows: list[_HeadRow]) -> None:
        """The draft steps of one batch; each row's cache ends holding its true slots only."""
        packed = self._pack(rows)
        feats = torch.zeros(len(rows), packed.input_ids.shape[1], self.hidden_size, device=self.device)
        for b, row in enumerate(rows):
            feats[b, : len(row.feed)] = row.features
        hidden, grown = self._pass(packed, feats)
        for b, row in enumerate(rows):  # the true slots stay; drafted ones never enter the session's cache
            row.cache.append_kv(batching.new_kv(grown, packed, b), row.feed)
            row.cache.commit(row.cache.branch_len)
        ends = torch.tensor([t - 1 for t in packed.input_lens], device=self.device)
        last = hidden[torch.arange(len(rows), device=self.device), ends]  # [batch, hidden]
        active: list[_HeadRow] = list(rows)
        first = True
        while True:
            for b, row in enumerate(active):
                if self.expand and row.request.tree.branches:
                    row.step_features.append(last[b])
            going = draw_step(active, self._logits(last))
            if not going:
                if self.expand:
                    self._expand([row for row in rows if row.candidates])
                return
            if first:
                packed = batching.align_ends(packed, grown)
                first = False
            packed = batching.next_step(packed, grown, [active[b].tokens[-1] for b in going], going)
            index = torch.tensor(going, device=self.device)
            active = [active[b] for b in going]
            hidden, grown = self._pass(packed, last.index_select(0, index).unsqueeze(1))  # [batch', 1, hidden]
            last = hidden[:, -1]

    def _expand(self, rows: list[_HeadRow]) -> None:
        """EAGLE-2's expansion below the chain's alternatives, one pass per level for every branching row. A
        candidate's slot takes the feature its parent's token took (the chain token beside it: the same
        feature, the same path above it) or, below an expanded candidate, that candidate's output; the head's
        output at a candidate ranks the candidates below it (``row.below``). Each level expands the new
        candidates that :func:`~specserve.draft.proposers.expandable` picks; each pass feeds a row's chain slots
        above its deepest pick (their keys were dropped), the candidates it expanded before and its picks, as a
        tree over its true slots."""
        outputs: dict[_HeadRow, dict[Key, torch.Tensor]] = {row: {} for row in rows}  # expanded key -> output
        frontier = {  # the candidates not expanded yet: the chain's runners-up first
            row: [(d, r) for d, listed in enumerate(row.candidates) for r in range(len(listed))] for row in rows
        }
        while True:
            todo = [(row, sorted(expandable(row, frontier[row]))) for row in rows]
            todo = [(row, picks) for row, picks in todo if picks]
            if not todo:
                return
            inputs, features = [], []
            for row, picks in todo:
                row.expansion_passes += 1
                done = outputs[row]
                # Parents first: the earlier levels' (shorter keys), then this level's picks, one level below.
                nodes = [*sorted(done, key=lambda k: (len(k), k)), *picks]
                chain = max(k[0] for k in nodes)  # the chain's slots above the nodes ((d, r) is beside chain[d])
                where = {k: chain + i for i, k in enumerate(nodes)}
                tree = (
                    *range(-1, chain - 1),
                    *((k[0] - 1) if len(k) == 2 else where[k[:-1]] for k in nodes),
                )
                feats = [
                    *row.step_features[:chain],
                    *(row.step_features[k[0]] if len(k) == 2 else done[k[:-1]] for k in nodes),
                ]
                inputs.append(
                    batching.RowInput(
                        past=tuple(row.cache.layer_kv()) or None, past_len=row.cache.seq_len,
                        input_ids=(*row.tokens[:chain], *(self._token(row, k) for k in nodes)),
                        logits_needed=len(picks), tree=tree,
                    )
                )  # fmt: skip
                features.append(feats)
            packed = batching.pack(inputs, config=self.config, device=self.device)
            feats = torch.zeros(len(todo), packed.input_ids.shape[1], self.hidden_size, device=self.device)
            for b, fed in enumerate(features):
                feats[b, : len(fed)] = torch.stack(fed)
            hidden, _ = self._pass(packed, feats)  # [B, T, hidden]
            for b, ((row, picks), t) in enumerate(zip(todo, packed.input_lens, strict=True)):
                got = hidden[b, t - len(picks) : t]  # [picks, hidden]
                logits = self._logits(got)  # [picks, vocab]
                new: list[Key] = []
                for i, key in enumerate(picks):
                    outputs[row][key] = got[i]
                    path = self._path(row, key)
                    row.below[key] = rank_children(logits[i], row, path, len(path) - 1)
                    new += [(*key, c) for c in range(len(row.below[key]))]
                frontier[row] = new

    @staticmethod
    def _token(row: _HeadRow, key: Key) -> int:
        """The token of the candidate named ``key``."""
        token = row.candidates[key[0]][key[1]][0]
        for depth in range(2, len(key)):
            token = row.below[key[:depth]][key[depth]][0]
        return token

    @classmethod
    def _path(cls, row: _HeadRow, key: Key) -> list[int]:
        """The tokens from depth 1 down to the candidate named ``key``, itself included."""
        return [*row.tokens[: key[0]], *(cls._token(row, key[:depth]) for depth in range(2, len(key) + 1))]
