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

Not thread-safe: a worker runs all model work and every mutation of its store
on its one :class:`~specserve.engine.model_thread.ModelThread` (docs/design.md,
"Conventions").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from specserve.api.errors import FailedPrecondition, InvalidArgument, NotFound
from specserve.engine.feature_head import FinalNormInput, target_features
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


class SessionCache:
    """One session's KV cache (a transformers ``DynamicCache``) and the tokens whose KV it holds."""

    def __init__(self, model: Any, session_id: str = "", *, clock: Callable[[], float] = time.monotonic):
        from transformers import DynamicCache

        self.model = model
        self.session_id = session_id
        self.vocab_size = vocab_size_of(model)
        limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        #: Most tokens the model can attend over (``max_position_embeddings``); ``None`` when unknown.
        self.max_positions: int | None = int(limit) if limit else None
        self._device = next(model.parameters()).device
        self._cache = DynamicCache(config=model.config)
        self._tokens: list[int] = []
        self._committed = 0
        self._nbytes: int | None = 0  # KV bytes held; None: recount (after a change)
        #: The target's features of the first cached positions (``[features_len, hidden]`` float16), kept
        #: once :meth:`track_features` was called (docs/design.md, "The feature head").
        self._features: torch.Tensor | None = None
        self._clock = clock
        self.last_used = clock()

    # ------------------------------------------------------------------ views

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
    def tracks_features(self) -> bool:
        """Whether the cache keeps its positions' features (:meth:`track_features`)."""
        return self._features is not None

    @property
    def features_len(self) -> int:
        """How many leading cached positions have their features kept (0 when none are tracked)."""
        return 0 if self._features is None else int(self._features.shape[0])

    def feature_rows(self, start: int, stop: int) -> torch.Tensor:
        """The kept features of positions ``[start, stop)``: ``[stop - start, hidden]`` float16."""
        if self._features is None or not 0 <= start <= stop <= self.features_len:
            raise InvalidArgument(f"features of positions [{start}, {stop}) are not held ({self.features_len} are)")
        return self._features[start:stop]

    def track_features(self) -> None:
        """Keep the features of every position fed from now on. Positions fed before have none: a
        caller that needs them treats the cache as holding only :attr:`features_len` positions."""
        if self._features is None:
            hidden = self.model.config.get_text_config(decoder=True).hidden_size
            self._features = torch.empty((0, hidden), dtype=torch.float16, device=self._device)
            self._nbytes = None

    def _append_features(self, rows: torch.Tensor, start: int) -> None:
        """Add the features ``rows`` ``[n, hidden]`` of positions ``start ..`` when they extend the kept ones."""
        if self._features is not None and start == self.features_len:
            self._features = torch.cat([self._features, rows.to(torch.float16)])
            self._nbytes = None

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values (and kept features) held (counted once per change: the store sums it
        every round)."""
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
    def _feed(self, token_ids: Sequence[int], *, logits_to_keep: int) -> torch.Tensor:
        """Feed tokens through the model; return the last ``logits_to_keep`` rows of logits."""
        self._check_room(len(self._tokens), len(token_ids))
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self._device)  # [1, n]
        start = len(self._tokens)
        if self._features is None:
            out = self.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=logits_to_keep)
        else:
            with FinalNormInput(self.model) as tap:
                out = self.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=logits_to_keep)
            self._append_features(features_of(self.model, tap.hidden[0]), start)
        self._tokens.extend(int(t) for t in token_ids)
        self._nbytes = None
        self.touch()
        return out.logits[0].float()  # [logits_to_keep, vocab]

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
        return self._feed(token_ids, logits_to_keep=keep)

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
        remove = len(self._tokens) - length
        if remove:
            self._cache.crop(-remove)
            del self._tokens[length:]
            self._nbytes = None
        if self._features is not None and self.features_len > length:
            self._features = self._features[:length]
            self._nbytes = None
        self._committed = min(self._committed, length)
        self.touch()

    def reset(self) -> None:
        """Drop everything (as after an eviction)."""
        self.truncate(0)

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
            last = self._feed(missing, logits_to_keep=1)[-1]  # [vocab]
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
        return [(layer.keys, layer.values) for layer in self._full_attention_layers()]

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
            self._cache.update(k, v, i)
        if features is not None:
            self._append_features(features, start)
        self._tokens.extend(int(t) for t in token_ids)
        self._nbytes = None
        self.touch()


def features_of(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``model``'s features (:func:`~specserve.engine.feature_head.target_features`) of last-layer states
    ``[..., hidden]`` captured before its final norm."""
    config = model.config.get_text_config(decoder=True)
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_epsilon", None) or 1e-6
    return target_features(hidden, eps)


class SessionCacheStore:
    """The session caches of one service: LRU eviction by count and bytes, TTL release."""

    def __init__(
        self,
        model: Any,
        *,
        max_sessions: int,
        budget_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.model = model
        self.max_sessions = max_sessions
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, SessionCache] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def session_ids(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._sessions)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def get(self, session_id: str) -> SessionCache | None:
        """The session's cache (marked most recently used), or ``None`` when unknown."""
        cache = self._sessions.get(session_id)
        if cache is not None:
            self._sessions.move_to_end(session_id)
            cache.touch()
        return cache

    def get_or_create(self, session_id: str) -> tuple[SessionCache, bool]:
        """The session's cache and whether it was just created (empty: rebuild by ``reconcile``)."""
        self.release_expired()
        cache = self.get(session_id)
        if cache is not None:
            return cache, False
        while len(self._sessions) >= self.max_sessions:
            self._evict_lru("max_sessions")
        cache = SessionCache(self.model, session_id, clock=self._clock)
        self._sessions[session_id] = cache
        self.trim(protect=(session_id,))
        return cache, True

    def release(self, session_id: str) -> None:
        """Drop a session's cache; :class:`NotFound` when the store does not hold it."""
        if self._sessions.pop(session_id, None) is None:
            raise NotFound(f"session {session_id!r} has no cache here (never seen, released or evicted)")

    def release_expired(self) -> list[str]:
        """Release sessions idle for longer than ``ttl_s``; return their ids."""
        now = self._clock()
        expired = [sid for sid, c in self._sessions.items() if now - c.last_used > self.ttl_s]
        for sid in expired:
            del self._sessions[sid]
            log.info("session_released", session_id=sid, reason="ttl")
        return expired

    def trim(self, protect: Sequence[str] = ()) -> list[str]:
        """Evict least recently used sessions (not in ``protect``) until the KV bytes fit the budget."""
        evicted: list[str] = []
        total = self.total_bytes
        for sid in list(self._sessions):
            if total <= self.budget_bytes:
                break
            if sid in protect:
                continue
            total -= self._sessions[sid].nbytes
            self._drop(sid, "kv_budget")
            evicted.append(sid)
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
        del self._sessions[session_id]
        log.info("session_evicted", session_id=session_id, reason=reason)
