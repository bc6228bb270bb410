"""One session's KV cache with an explicit branch, and a per-service store of them.

Terms
-----
``C``
    The session's committed tokens (prompt + generated), as the log in Redis
    holds them; ``len(C) = n``.
cached tokens (``SessionCache.tokens``)
    The tokens whose keys and values the cache holds, in order. Entry ``i`` is
    the KV of the token at absolute position ``i``.
committed part / branch
    The first ``committed_len`` cached tokens are known committed; the rest
    (``branch_len`` tokens) are a tentative **branch** added by :meth:`SessionCache.extend`
    (draft tokens being proposed or verified). :meth:`SessionCache.commit` makes
    a prefix of the branch committed; :meth:`SessionCache.rollback` crops the rest.

The pending-token convention
----------------------------
A next-token distribution after ``C`` needs the logits of the *last* token of
``C``, and logits only come out of a forward pass that feeds that token. So a
cache is always in one of two states with respect to ``C``:

* **full** (what the draft uses, ``reconcile(C)``): the cached tokens are
  exactly ``C``; ``reconcile`` returns the next-token logits after ``C`` (it
  fed at least the last token of ``C`` to get them; when the cache already held
  all of ``C`` it crops and re-feeds that one token).
* **pending** (what the target uses, ``reconcile(C, pending=True)``): the cached
  tokens are exactly ``C[:-1]``; ``C[-1]`` is the *pending token*, whose KV is
  not computed yet. The target's verify pass then feeds ``[C[-1], x1..x_gamma]``
  in one go and gets ``gamma + 1`` next-token distributions.

Between rounds a cache may hold more than that (the branch of the last round:
rejected draft tokens); :meth:`SessionCache.reconcile` restores the invariant
before every use (docs/design.md, invariant 3): it keeps the longest common prefix of
the cached tokens and ``C``, crops the rest and feeds what is missing. Tokens
of the branch that the round accepted are therefore kept, not recomputed.

Batching several sessions (the target)
--------------------------------------
:meth:`SessionCache.layer_kv` exposes the per-layer ``(keys, values)`` tensors
(``[1, kv_heads, seq_len, head_dim]``) and :meth:`SessionCache.append_kv` appends
KV computed elsewhere (e.g. sliced out of one batched forward pass over many
sessions) together with the tokens it belongs to, as a branch. Only models whose
layers are all full attention (``DynamicLayer``: Llama, GPT-2, Qwen, ...) are
supported by these two; sliding-window layers raise ``FailedPrecondition``.

The store
---------
:class:`SessionCacheStore` maps session ids to caches for one service, keeps at
most ``max_sessions`` of them and at most ``budget_bytes`` of KV, evicts the
least recently used first, and releases sessions idle longer than ``ttl_s``. An
evicted or unknown session is simply rebuilt by ``reconcile`` from the committed
tokens a request carries (re-prefill).

The prefix cache
----------------
The store also shares committed KV between sessions (docs/design.md, "The prefix cache"). A session's
cache is a chain of shared blocks (:class:`Block`: ``block_tokens`` committed tokens each, immutable,
reference-counted) followed by its private tail (the committed tokens after its last whole block and its
branch). :meth:`SessionCacheStore.share` turns each whole committed block of a session's private tail into
a shared block (or points it at an identical one already held); :meth:`SessionCacheStore.attach` gives a
new (empty) session the longest chain of held blocks that its committed tokens start with, so it feeds only
the rest. A block is keyed by its parent block and its own tokens, and a chain's first block also by its
session's **cache scope** (:attr:`SessionCache.scope`: the coordinator's hash of the tenant and any salt,
docs/design.md, "The prefix cache") and its **lead** (:attr:`SessionCache.lead`: the tokens before its first
that its keys and values depend on, the feature head's position 0), so a chain is found only for exactly the
tokens it was computed from and only by sessions of the scope it was made under. Blocks count in
``budget_bytes`` once however many sessions hold them; a block no session holds stays cached and is evicted
least-recently-used, sessions and free blocks in one order; a block a session holds is never evicted (the
session goes first). Stores may share one budget (:class:`KVBudget`: a draft's model and its feature head),
evicted in one order.

A session that keeps the target's features (:meth:`SessionCache.track_features`, the feature head's) keeps
them in its blocks too (``Block.features``): it shares its blocks with their features (filling in those of
a block another session made without), and attaches only blocks that bring theirs, so the next turn of a
conversation that drafts with the head reads its history's features without computing them again
(docs/design.md, "The prefix cache", "With the feature head").

Not thread-safe: a worker runs all model work and every mutation of its store
on its one :class:`~specserve.engine.model_thread.ModelThread` (docs/design.md,
"Conventions").
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from transformers.cache_utils import DynamicLayer

from specserve.api.errors import FailedPrecondition, InvalidArgument, NotFound
from specserve.engine import batching
from specserve.engine.feature_maker import FeatureMaker
from specserve.engine.models import vocab_size_of

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Reconciled:
    """What :meth:`SessionCache.reconcile` did."""

    kept: int  # cached tokens kept (longest common prefix, capped by the target state)
    fed: int  # tokens fed through the model to catch up (the prefill work)
    logits: torch.Tensor | None  # [vocab] float32 next-token logits after C; None when pending=True


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)
class Block:
    """``len(tokens)`` consecutive committed tokens' keys and values, shared by reference between sessions.

    Immutable once made; ``refs`` counts the sessions whose cache starts with the chain ending here.
    """

    id: int  # unique in its store (0 is the root: no block)
    parent: Block | None  # the block before it (None: it starts at position 0)
    tokens: tuple[int, ...]
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), each [1, kv_heads, B, head_dim]
    nbytes: int  # keys, values and features
    start: int  # absolute position of its first token
    scope: bytes = b""  # the cache scope of the sessions that may hold it (its parent's, for a later block)
    refs: int = 0
    last_used: float = 0.0
    children: dict[tuple[int, ...], Block] = field(default_factory=dict)
    #: The target's features of its positions (``[B, hidden]`` float16), kept when a session that tracks them
    #: computed or shared it (None: not known; a tracking session does not attach it).
    features: torch.Tensor | None = None
    lead: tuple[int, ...] = ()  # a root block's chain key beside its tokens (``SessionCache.lead``)

    @property
    def root_key(self) -> tuple[bytes, tuple[int, ...]]:
        """What a chain's first block is found under beside its tokens: its scope and lead."""
        return self.scope, self.lead


class SharedPrefixLayer(DynamicLayer):
    """A full-attention cache layer whose first positions are shared blocks' keys and values.

    ``keys`` / ``values`` hold the private tail only; :meth:`update` returns the whole sequence (the
    shared blocks' tensors, then the tail) as attention needs it, a transient copy like
    ``DynamicLayer``'s own concatenation.
    """

    def __init__(self) -> None:
        super().__init__()
        self.prefix_k: list[torch.Tensor] = []  # per block [1, kv_heads, B, head_dim]
        self.prefix_v: list[torch.Tensor] = []
        self.prefix_len = 0

    def tail_len(self) -> int:
        return super().get_seq_length()

    def get_seq_length(self) -> int:
        return self.prefix_len + super().get_seq_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states)
        if not self.prefix_k:
            return keys, values
        return torch.cat([*self.prefix_k, keys], dim=-2), torch.cat([*self.prefix_v, values], dim=-2)

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of every position, each ``[1, kv_heads, seq_len, head_dim]`` (a copy when
        shared blocks are part of it)."""
        if not self.prefix_k:
            return self.keys, self.values
        ks, vs = list(self.prefix_k), list(self.prefix_v)
        if self.tail_len():
            ks.append(self.keys)
            vs.append(self.values)
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def set_tail(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        """Replace the private tail (``None`` or zero positions: empty)."""
        if keys is None or values is None or keys.shape[-2] == 0:
            self.keys = self.values = None
            self.is_initialized = False
        else:
            self.device = keys.device
            self.keys, self.values = keys, values
            self.is_initialized = True


class SessionCache:
    """One session's KV cache (a transformers ``DynamicCache``) and the tokens whose KV it holds."""

    def __init__(
        self,
        model: Any,
        session_id: str = "",
        *,
        scope: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
        feature_maker: FeatureMaker | None = None,
    ):
        from transformers import DynamicCache

        self.model = model
        #: What makes its positions' features once it tracks them (None: the last layer's feature).
        self.feature_maker = feature_maker or FeatureMaker(model)
        self.session_id = session_id
        #: The session's cache scope: it attaches and shares only blocks of this scope (the store's prefix cache).
        self.scope = scope
        self.vocab_size = vocab_size_of(model)
        limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        #: Most tokens the model can attend over (``max_position_embeddings``); ``None`` when unknown.
        self.max_positions: int | None = int(limit) if limit else None
        self._device = next(model.parameters()).device
        self._cache = DynamicCache(config=model.config)
        layers = list(self._cache.layers)
        #: Whether the cache can hold shared blocks (every layer full attention, ``DynamicLayer``).
        self.shareable = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
        if self.shareable:
            self._cache.layers = [SharedPrefixLayer() for _ in layers]
        self._blocks: list[Block] = []  # the shared blocks its first cached tokens are, in order
        self._tokens: list[int] = []
        self._committed = 0
        self._nbytes: int | None = 0  # KV bytes held; None: recount (after a change)
        #: The target's features of the private tail's first positions (``[rows, hidden]`` float16, from
        #: :attr:`shared_len` on; the shared blocks hold their own), kept once :meth:`track_features` was
        #: called (docs/design.md, "The feature head").
        self._features: torch.Tensor | None = None
        #: Tokens before the first cached one that its keys and values depend on, part of the key of the
        #: first shared block (the feature head's cache starts at slot 1, which reads position 0's feature:
        #: its lead is that token). Empty for a model's own cache, which starts at position 0.
        self.lead: tuple[int, ...] = ()
        self._clock = clock
        self.last_used = clock()

    # ------------------------------------------------------------------ views

    @property
    def root_key(self) -> tuple[bytes, tuple[int, ...]]:
        """What the first shared block of this cache is found under beside its tokens: scope and lead."""
        return self.scope, self.lead

    @property
    def tokens(self) -> tuple[int, ...]:
        """Tokens whose KV the cache holds, committed part then branch."""
        return tuple(self._tokens)

    @property
    def committed_len(self) -> int:
        """Number of leading cached tokens that are committed."""
        return self._committed

    @property
    def committed_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens[: self._committed])

    @property
    def branch_len(self) -> int:
        """Number of cached tokens after the committed part (the tentative branch)."""
        return len(self._tokens) - self._committed

    @property
    def seq_len(self) -> int:
        """Number of cached tokens; also the absolute position of the next token fed."""
        return len(self._tokens)

    @property
    def kv_len(self) -> int:
        """Positions whose keys and values the cache holds (:attr:`seq_len` whenever it is consistent)."""
        return self._cache.get_seq_length()

    @property
    def shared_len(self) -> int:
        """Leading cached tokens held in shared blocks (the rest is this session's own)."""
        return self._blocks[-1].start + len(self._blocks[-1].tokens) if self._blocks else 0

    @property
    def blocks(self) -> tuple[Block, ...]:
        """The shared blocks this cache starts with, in order."""
        return tuple(self._blocks)

    @property
    def tracks_features(self) -> bool:
        """Whether the cache keeps its positions' features (:meth:`track_features`)."""
        return self._features is not None

    @property
    def features_len(self) -> int:
        """How many leading cached positions have their features kept (0 when none are tracked): the shared
        blocks' (up to the first that has none) and then the private tail's."""
        if self._features is None:
            return 0
        held = 0
        for block in self._blocks:
            if block.features is None:
                return held
            held += len(block.tokens)
        return held + int(self._features.shape[0])

    def feature_rows(self, start: int, stop: int) -> torch.Tensor:
        """The kept features of positions ``[start, stop)``: ``[stop - start, hidden]`` float16."""
        if self._features is None or not 0 <= start <= stop <= self.features_len:
            raise InvalidArgument(f"features of positions [{start}, {stop}) are not held ({self.features_len} are)")
        parts = []
        for block in self._blocks:
            lo, hi = max(start, block.start), min(stop, block.start + len(block.tokens))
            if lo < hi:
                assert block.features is not None  # within features_len
                parts.append(block.features[lo - block.start : hi - block.start])
        base = self.shared_len
        if stop > max(start, base):
            parts.append(self._features[max(start, base) - base : stop - base])
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else self._features[:0]

    def track_features(self) -> None:
        """Keep the features of every position fed from now on. Positions fed before have none: a
        caller that needs them treats the cache as holding only :attr:`features_len` positions."""
        if self._features is None:
            hidden = self.model.config.get_text_config(decoder=True).hidden_size
            self._features = torch.empty((0, hidden), dtype=torch.float16, device=self._device)
            self._nbytes = None

    def _append_features(self, rows: torch.Tensor, start: int) -> None:
        """Add the features ``rows`` ``[n, hidden]`` of positions ``start ..`` when they extend the kept ones
        (the private tail's: ``start`` is past the shared blocks)."""
        if self._features is not None and start == self.features_len and start >= self.shared_len:
            self._features = torch.cat([self._features, rows.to(torch.float16)])
            self._nbytes = None

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values (and kept features) this session holds of its own, shared blocks not
        included (counted once per change: the store sums it every round)."""
        if self._nbytes is None:
            total = 0 if self._features is None else self._features.numel() * self._features.element_size()
            for layer in self._cache.layers:
                if getattr(layer, "is_initialized", False) and layer.keys is not None:
                    total += layer.keys.numel() * layer.keys.element_size()
                    total += layer.values.numel() * layer.values.element_size()
            self._nbytes = total
        return self._nbytes

    def touch(self) -> None:
        self.last_used = self._clock()

    # ------------------------------------------------------------- mutators

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            if not 0 <= int(t) < self.vocab_size:
                raise InvalidArgument(f"token id {t} is out of range; ids must be in [0, {self.vocab_size})")

    def _check_room(self, start: int, n: int) -> None:
        if self.max_positions is not None and start + n > self.max_positions:
            raise InvalidArgument(
                f"session {self.session_id!r} would hold {start + n} tokens but the model handles at most "
                f"{self.max_positions} positions; end the generation earlier (max_new_tokens) or shorten the prompt"
            )

    @torch.inference_mode()
    def _feed(
        self, token_ids: Sequence[int], *, logits_to_keep: int, tree: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed tokens through the model; return the last ``logits_to_keep`` rows of logits and, when the
        cache tracks features, every fed position's ``[n, hidden]`` (float32). ``tree``: the parents of the
        last ``len(tree)`` tokens, a draft tree (:meth:`extend_tree`): their features are not kept."""
        self._check_room(len(self._tokens), len(token_ids))
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._device)  # [1, n]
        start = len(self._tokens)
        inputs: dict[str, Any] = {}
        if tree:
            dtype = next(self.model.parameters()).dtype
            inputs = batching.tree_pass_inputs(start, len(token_ids), tree, dtype, self._device)
        rows = None
        if self._features is None:
            out = self.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=logits_to_keep,
                             **inputs)
        else:
            with self.feature_maker.tap() as tap:
                out = self.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=logits_to_keep,
                                 **inputs)
            rows = tap.rows(0, len(token_ids))
            self._append_features(rows[: len(token_ids) - len(tree or ())], start)
        self._tokens.extend(int(t) for t in token_ids)
        self._nbytes = None
        self.touch()
        return out.logits[0].float(), rows  # [logits_to_keep, vocab]

    def extend(self, token_ids: Sequence[int], *, logits_to_keep: int | None = None) -> torch.Tensor:
        """Feed ``token_ids`` as a tentative branch; return the next-token logits of the last
        ``logits_to_keep`` of them (None: all) ``[logits_to_keep, vocab]`` float32.

        Row ``i`` of all ``n`` is the distribution of the token after ``token_ids[i]``; the output head
        runs on the kept rows only (a prompt fed with a proposal pays it for the proposal's rows).
        """
        if len(token_ids) == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self._device)
        self._check_ids(token_ids)
        keep = len(token_ids) if logits_to_keep is None else logits_to_keep
        if not 1 <= keep <= len(token_ids):
            raise InvalidArgument(f"logits_to_keep must be 1..{len(token_ids)}, got {keep}")
        return self._feed(token_ids, logits_to_keep=keep)[0]

    def extend_tree(
        self, token_ids: Sequence[int], parents: Sequence[int], *, logits_to_keep: int
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """Feed ``token_ids``, whose last ``len(parents)`` are a draft tree (each node at its parent's position
        + 1, seeing the tokens before the tree and its own ancestors), in one pass over this cache.

        The tokens before the tree stay as a branch, as :meth:`extend` leaves them; the tree's nodes do not:
        their per-layer ``(keys, values)`` ``[1, kv_heads, nodes, head_dim]`` and, when the cache tracks
        features, their ``[nodes, hidden]`` features come back beside the logits of the last
        ``logits_to_keep`` tokens, for the accepted path to be appended (:meth:`append_kv`). A lone session's
        tree costs this one pass and no copy of its past (a batch packs its rows, ``batching.pack``).
        """
        nodes = len(parents)
        if not 1 <= nodes <= len(token_ids) or not 1 <= logits_to_keep <= len(token_ids):
            raise InvalidArgument(
                f"extend_tree needs 1..{len(token_ids)} tree nodes and logits of 1..{len(token_ids)} tokens, "
                f"got {nodes} and {logits_to_keep}"
            )
        self._check_ids(token_ids)
        kept = len(self._tokens) + len(token_ids) - nodes
        logits, rows = self._feed(token_ids, logits_to_keep=logits_to_keep, tree=parents)
        tree_kv = [
            (layer.keys[..., -nodes:, :].clone(), layer.values[..., -nodes:, :].clone()) for layer in self._cache.layers
        ]
        self.truncate(kept)
        return logits, tree_kv, None if rows is None else rows[-nodes:]

    def commit(self, n: int) -> None:
        """Make the first ``n`` tokens of the branch committed."""
        if not 0 <= n <= self.branch_len:
            raise InvalidArgument(f"cannot commit {n} tokens: the branch holds {self.branch_len}")
        self._committed += n
        self.touch()

    def rollback(self) -> int:
        """Crop the branch (every uncommitted cached token); return how many tokens were removed."""
        removed = self.branch_len
        self.truncate(self._committed)
        return removed

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (committed ones included)."""
        if not 0 <= length <= len(self._tokens):
            raise InvalidArgument(f"cannot truncate to {length} tokens: the cache holds {len(self._tokens)}")
        if length < self.shared_len:
            self._cut_shared(length)
        remove = len(self._tokens) - length
        if remove:
            self._cache.crop(-remove)
            del self._tokens[length:]
            self._nbytes = None
        tail = max(0, length - self.shared_len)
        if self._features is not None and self._features.shape[0] > tail:
            self._features = self._features[:tail]
            self._nbytes = None
        self._committed = min(self._committed, length)
        self.touch()

    def reset(self) -> None:
        """Drop everything (as after an eviction)."""
        self.truncate(0)

    # ------------------------------------------------------ shared blocks (the store's)

    def _shared_layers(self) -> list[SharedPrefixLayer]:
        return [layer for layer in self._cache.layers if isinstance(layer, SharedPrefixLayer)]

    def _take_blocks(self, blocks: Sequence[Block]) -> None:
        """Hold ``blocks``, the next shared blocks after :attr:`shared_len`: either the KV of cached tokens
        (their private copy is dropped) or, on an empty cache, tokens attached from the store."""
        if not blocks:
            return
        if not self.shareable:
            raise FailedPrecondition("this model's cache layers cannot hold shared blocks")
        start = self.shared_len
        n = sum(len(b.tokens) for b in blocks)
        attaching = start == len(self._tokens)
        if not attaching and self._tokens[start : start + n] != [t for b in blocks for t in b.tokens]:
            raise InvalidArgument("shared blocks must hold the cached tokens they replace")
        for i, layer in enumerate(self._shared_layers()):
            layer.prefix_k.extend(b.kv[i][0] for b in blocks)
            layer.prefix_v.extend(b.kv[i][1] for b in blocks)
            layer.prefix_len += n
            tail = layer.tail_len()
            if tail > n:  # the rest is copied so that the private storage of the shared part goes
                layer.set_tail(layer.keys[..., n:, :].clone(), layer.values[..., n:, :].clone())
            else:
                layer.set_tail(None, None)
        if self._features is not None and not attaching:  # the blocks hold these positions' features now
            self._features = self._features[n:].clone()
        now = self._clock()
        for b in blocks:
            b.refs += 1
            b.last_used = now
        self._blocks.extend(blocks)
        if attaching:
            self._tokens.extend(t for b in blocks for t in b.tokens)
            self._committed = len(self._tokens)
        self._nbytes = None
        self.touch()

    def _cut_shared(self, length: int) -> None:
        """Keep the shared blocks wholly within the first ``length`` tokens; the rest of the shared part
        up to ``length`` is copied into the private tail (everything after ``length`` is dropped)."""
        keep = 0
        while keep < len(self._blocks) and self._blocks[keep].start + len(self._blocks[keep].tokens) <= length:
            keep += 1
        partial = length - (self._blocks[keep - 1].start + len(self._blocks[keep - 1].tokens) if keep else 0)
        for i, layer in enumerate(self._shared_layers()):
            del layer.prefix_k[keep:], layer.prefix_v[keep:]
            layer.prefix_len = sum(len(b.tokens) for b in self._blocks[:keep])
            if partial:
                k, v = self._blocks[keep].kv[i]
                layer.set_tail(k[..., :partial, :].clone(), v[..., :partial, :].clone())
            else:
                layer.set_tail(None, None)
        if self._features is not None:  # the tail's features: the cut block's first rows, where it has them
            rows = self._blocks[keep].features if partial else None
            self._features = self._features[:0] if rows is None else rows[:partial].clone()
        self._drop_blocks(self._blocks[keep:])
        del self._blocks[keep:]
        del self._tokens[length:]
        self._nbytes = None

    def _drop_blocks(self, blocks: Sequence[Block]) -> None:
        for b in reversed(blocks):
            b.refs -= 1
            b.last_used = max(b.last_used, self.last_used)

    def detach(self) -> None:
        """Stop holding shared blocks (the session leaves the store); they stay cached for others."""
        self._drop_blocks(self._blocks)
        self._blocks = []

    def reconcile(self, committed_tokens: Sequence[int], *, pending: bool = False) -> Reconciled:
        """Bring the cache in line with the committed tokens ``C`` (see the module docstring).

        ``pending=False``: afterwards the cached tokens are exactly ``C`` (all
        committed) and the result carries the next-token logits after ``C``
        (``[vocab]`` float32). ``C`` must not be empty.
        ``pending=True``: afterwards the cached tokens are exactly ``C[:-1]`` and
        ``C[-1]`` is the pending token; ``logits`` is ``None``.
        """
        c = [int(t) for t in committed_tokens]
        if not c:
            raise InvalidArgument("the committed prefix is empty: a session needs at least one prompt token")
        self._check_ids(c)
        self._check_room(0, len(c))
        want = len(c) - 1 if pending else len(c)
        # Keep the longest common prefix, but always leave one token to feed when we need logits.
        keep = min(common_prefix_len(self._tokens, c), want if pending else want - 1)
        if self._features is not None:  # positions without their features are fed again
            keep = min(keep, self.features_len)
        self.truncate(keep)
        self._committed = keep
        missing = c[keep:want]
        logits = None
        if missing:
            last = self._feed(missing, logits_to_keep=1)[0][-1]  # [vocab]
            logits = None if pending else last
        self._committed = want
        self.touch()
        log.debug("cache_reconciled", session_id=self.session_id, kept=keep, fed=len(missing))
        return Reconciled(kept=keep, fed=len(missing), logits=logits)

    # ----------------------------------------------------- batching support

    def _full_attention_layers(self) -> list[Any]:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        layers = list(self._cache.layers)
        for layer in layers:
            if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
                raise FailedPrecondition(
                    f"layer_kv/append_kv support full-attention layers only, found {type(layer).__name__}"
                )
        return layers

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)``, each ``[1, kv_heads, seq_len, head_dim]``; empty list before any feed.

        The tensors are the cache's own: read them, do not modify them in place.
        """
        if not self._tokens:
            return []
        layers = self._full_attention_layers()
        if self._blocks:
            return [layer.whole() for layer in self._shared_layers()]
        return [(layer.keys, layer.values) for layer in layers]

    def append_kv(
        self,
        layer_kvs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        token_ids: Sequence[int],
        features: torch.Tensor | None = None,
    ) -> None:
        """Append KV computed elsewhere for ``token_ids`` (positions ``seq_len ..``) as a branch.

        ``layer_kvs[l]`` is ``(keys, values)`` of layer ``l``, each
        ``[1, kv_heads, len(token_ids), head_dim]``, computed with the position
        ids ``seq_len, seq_len + 1, ...`` and attending to exactly this session's
        cached tokens. ``features`` ``[len(token_ids), hidden]``: the same pass's features of those
        positions, kept when the cache tracks them.
        """
        n = len(token_ids)
        if n == 0:
            return
        self._check_ids(token_ids)
        n_layers = self.model.config.get_text_config(decoder=True).num_hidden_layers
        if len(layer_kvs) != n_layers:
            raise InvalidArgument(f"append_kv needs KV for {n_layers} layers, got {len(layer_kvs)}")
        for i, (k, v) in enumerate(layer_kvs):
            if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != n or v.shape[:3] != k.shape[:3]:
                raise InvalidArgument(
                    f"append_kv layer {i}: keys/values must be [1, kv_heads, {n}, head_dim], "
                    f"got {tuple(k.shape)} / {tuple(v.shape)}"
                )
        if self._tokens:
            self._full_attention_layers()
        self._check_room(len(self._tokens), n)
        start = len(self._tokens)
        for i, (k, v) in enumerate(layer_kvs):
            layer = self._cache.layers[i] if i < len(self._cache.layers) else None
            if isinstance(layer, SharedPrefixLayer):
                DynamicLayer.update(layer, k, v)  # the tail grows; no copy of the whole sequence
            else:
                self._cache.update(k, v, i)
        if features is not None:
            self._append_features(features, start)
        self._tokens.extend(int(t) for t in token_ids)
        self._nbytes = None
        self.touch()


@dataclass
class PrefixStats:
    """The prefix cache's counters since the store was made (vLLM's names: tokens, not requests)."""

    queries: int = 0  # committed tokens of new (empty) caches looked up
    hits: int = 0  # of those, tokens found in shared blocks (attached, not fed)
    blocks_made: int = 0  # shared blocks created
    blocks_evicted: int = 0  # shared blocks evicted for the budget


class KVBudget:
    """One memory budget for the stores of a process that share it (a draft's model and its feature head):
    :meth:`SessionCacheStore.trim` on any of them evicts from all of them, least recently used first."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.stores: list[SessionCacheStore] = []

    @property
    def total_bytes(self) -> int:
        """The bytes every store sharing the budget holds."""
        return sum(store.total_bytes for store in self.stores)


class SessionCacheStore:
    """The session caches of one service and their shared blocks: LRU eviction by count and bytes,
    TTL release (see the module docstring, "The prefix cache").

    ``budget_bytes``: the store's own budget, or a :class:`KVBudget` it shares with other stores;
    ``feature_maker``: what makes the features of the sessions that track them (None: the last layer's)."""

    def __init__(
        self,
        model: Any,
        *,
        max_sessions: int,
        budget_bytes: int | KVBudget,
        ttl_s: float,
        prefix_cache: bool = True,
        block_tokens: int = 16,
        on_lookup: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        feature_maker: FeatureMaker | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.model = model
        self.feature_maker = feature_maker or FeatureMaker(model)
        self.max_sessions = max_sessions
        #: The budget this store counts against (its own, or one shared with other stores).
        self.budget = budget_bytes if isinstance(budget_bytes, KVBudget) else KVBudget(budget_bytes)
        self.budget.stores.append(self)
        self.ttl_s = ttl_s
        #: Whether sessions share committed blocks (off: every session prefills its own).
        self.prefix_cache = prefix_cache
        self.block_tokens = block_tokens
        self.stats = PrefixStats()
        self._on_lookup = on_lookup  # (tokens queried, tokens hit) of each lookup, for the worker's metrics
        self._clock = clock
        self._sessions: OrderedDict[str, SessionCache] = OrderedDict()  # least recently used first
        #: Blocks at position 0, by cache scope and lead (:attr:`SessionCache.root_key`), then by their tokens: a
        #: chain starts only in its own scope.
        self._roots: dict[tuple[bytes, tuple[int, ...]], dict[tuple[int, ...], Block]] = {}
        self._blocks: dict[int, Block] = {}  # every shared block, by id
        self._block_bytes = 0
        self._next_id = 1

    @property
    def budget_bytes(self) -> int:
        """The bytes the store (with the stores it shares its budget with) may hold."""
        return self.budget.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        self.budget.budget_bytes = value

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def session_ids(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._sessions)

    @property
    def total_bytes(self) -> int:
        """KV bytes held: every session's own plus every shared block once."""
        return sum(s.nbytes for s in self._sessions.values()) + self._block_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of the shared blocks (held by sessions or free)."""
        return self._block_bytes

    @property
    def block_count(self) -> int:
        return len(self._blocks)

    @property
    def held_block_count(self) -> int:
        """Shared blocks some session holds (none once every session is released: the rest are free to evict)."""
        return sum(1 for block in self._blocks.values() if block.refs)

    def get(self, session_id: str) -> SessionCache | None:
        """The session's cache (marked most recently used), or ``None`` when unknown."""
        cache = self._sessions.get(session_id)
        if cache is not None:
            self._sessions.move_to_end(session_id)
            cache.touch()
        return cache

    def get_or_create(self, session_id: str, *, scope: bytes = b"") -> tuple[SessionCache, bool]:
        """The session's cache and whether it was just created (empty: rebuild by ``reconcile``, after
        :meth:`attach`). ``scope``: the session's cache scope (:attr:`SessionCache.scope`); a cache held under
        another scope is dropped and made again under this one, so no block crosses scopes."""
        self.release_expired()
        cache = self.get(session_id)
        if cache is not None and cache.scope == scope:
            return cache, False
        if cache is not None:
            self._drop(session_id, "cache_scope")
        while len(self._sessions) >= self.max_sessions:
            self._evict_lru("max_sessions")
        cache = SessionCache(
            self.model, session_id, scope=scope, clock=self._clock, feature_maker=self.feature_maker
        )
        self._sessions[session_id] = cache
        self.trim(protect=(session_id,))
        return cache, True

    # ------------------------------------------------------------------ the prefix cache

    def attach(self, cache: SessionCache, committed: Sequence[int], *, most: int) -> int:
        """Give an empty ``cache`` the longest chain of shared blocks of its scope (:attr:`SessionCache.scope`)
        that ``committed`` starts with, at most ``most`` tokens; returns how many tokens it attached (0 when
        the cache is not empty, the prefix cache is off or nothing matches). Counted in :attr:`stats` when
        the cache was empty."""
        if cache.seq_len or not self.prefix_cache or not cache.shareable:
            return 0
        b = self.block_tokens
        chain: list[Block] = []
        children = self._roots.get(cache.root_key, {})
        pos = 0
        while pos + b <= most:
            block = children.get(tuple(int(t) for t in committed[pos : pos + b]))
            if block is None or (cache.tracks_features and block.features is None):
                break  # a session that keeps features attaches only blocks that bring theirs
            chain.append(block)
            children = block.children
            pos += b
        cache._take_blocks(chain)
        self.stats.queries += len(committed)
        self.stats.hits += pos
        if self._on_lookup is not None:
            self._on_lookup(len(committed), pos)
        if pos:
            log.debug("prefix_attached", session_id=cache.session_id, tokens=pos, queried=len(committed))
        return pos

    def share(self, cache: SessionCache) -> int:
        """Make every whole block of ``cache``'s committed tokens shared under its scope (pointing it at an
        identical block of that scope already held, or making one from the cache's own KV); returns the blocks
        it took."""
        if not self.prefix_cache or not cache.shareable or cache.session_id not in self._sessions:
            return 0
        b = self.block_tokens
        start = cache.shared_len
        end = min(cache.committed_len, cache.features_len) if cache.tracks_features else cache.committed_len
        whole = (end - start) // b
        if whole <= 0 or start % b:
            return 0
        tokens = cache.tokens
        parent = cache.blocks[-1] if cache.blocks else None
        layers = cache._shared_layers()
        taken: list[Block] = []
        for i in range(whole):
            pos = start + i * b
            off = pos - start  # in the private tail
            key = tokens[pos : pos + b]
            siblings = self._roots.setdefault(cache.root_key, {}) if parent is None else parent.children
            block = siblings.get(key)
            if block is None:
                kv = tuple(
                    (layer.keys[..., off : off + b, :].clone(), layer.values[..., off : off + b, :].clone())
                    for layer in layers
                )
                nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
                block = Block(
                    id=self._next_id,
                    parent=parent,
                    tokens=key,
                    kv=kv,
                    nbytes=nbytes,
                    start=pos,
                    scope=cache.scope,
                    lead=cache.lead,
                )
                self._next_id += 1
                siblings[key] = block
                self._blocks[block.id] = block
                self._block_bytes += nbytes
                self.stats.blocks_made += 1
            if cache.tracks_features and block.features is None:  # the block keeps the features too
                rows = cache._features[off : off + b].clone()  # type: ignore[index]
                block.features = rows
                block.nbytes += rows.numel() * rows.element_size()
                self._block_bytes += rows.numel() * rows.element_size()
            taken.append(block)
            parent = block
        cache._take_blocks(taken)
        return len(taken)

    def _evict_block(self, block: Block) -> int:
        """Evict a free block and every block after it (free too: a holder holds the whole chain);
        returns the bytes freed."""
        freed = 0
        for child in list(block.children.values()):
            freed += self._evict_block(child)
        siblings = self._roots.get(block.root_key, {}) if block.parent is None else block.parent.children
        siblings.pop(block.tokens, None)
        if block.parent is None and not siblings:
            self._roots.pop(block.root_key, None)
        self._blocks.pop(block.id, None)
        self._block_bytes -= block.nbytes
        self.stats.blocks_evicted += 1
        return freed + block.nbytes

    # ------------------------------------------------------------------ eviction

    def release(self, session_id: str) -> None:
        """Drop a session's cache; :class:`NotFound` when the store does not hold it. Its shared blocks
        stay cached."""
        cache = self._sessions.pop(session_id, None)
        if cache is None:
            raise NotFound(f"session {session_id!r} has no cache here (never seen, released or evicted)")
        cache.detach()

    def release_expired(self) -> list[str]:
        """Release sessions idle for longer than ``ttl_s``; return their ids."""
        now = self._clock()
        expired = [sid for sid, c in self._sessions.items() if now - c.last_used > self.ttl_s]
        for sid in expired:
            self._sessions.pop(sid).detach()
            log.info("session_released", session_id=sid, reason="ttl")
        return expired

    def trim(self, protect: Sequence[str] = ()) -> list[str]:
        """Evict until the KV bytes fit the budget: sessions (not in ``protect``) and free shared blocks of
        every store sharing the budget, least recently used first (a chain's end before its start, a session
        before a block of the same time); returns the evicted sessions."""
        evicted: list[str] = []
        stores = self.budget.stores
        total = self.budget.total_bytes
        if total <= self.budget_bytes:
            return evicted
        order = itertools.count()  # ties never compare stores or blocks
        heap: list[tuple[float, int, int, int, SessionCacheStore, Block | str]] = []

        def free(store: SessionCacheStore, block: Block) -> None:
            heapq.heappush(heap, (block.last_used, 1, -block.start, next(order), store, block))

        for store in stores:
            for block in store._blocks.values():
                if block.refs == 0:
                    free(store, block)
            for sid, cache in store._sessions.items():
                if sid not in protect:
                    heapq.heappush(heap, (cache.last_used, 0, 0, next(order), store, sid))
        while total > self.budget_bytes and heap:
            *_, store, what = heapq.heappop(heap)
            if isinstance(what, str):
                cache = store._sessions.get(what)
                if cache is None:
                    continue
                total -= cache.nbytes
                held = cache.blocks
                store._drop(what, "kv_budget")
                evicted.append(what)
                for block in held:
                    if block.refs == 0:
                        free(store, block)
            elif store._blocks.get(what.id) is what and what.refs == 0:  # not gone with a block before it
                total -= store._evict_block(what)
        if total > self.budget_bytes:
            log.warning(
                "kv_budget_exceeded", bytes=total, budget_bytes=self.budget_bytes, protected=list(protect)
            )
        return evicted

    def _evict_lru(self, reason: str) -> str:
        sid = next(iter(self._sessions))
        self._drop(sid, reason)
        return sid

    def _drop(self, session_id: str, reason: str) -> None:
        self._sessions.pop(session_id).detach()
        log.info("session_evicted", session_id=session_id, reason=reason)
