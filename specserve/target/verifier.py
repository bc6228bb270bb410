"""The batched verifier: one forward pass for many sessions' proposals, exact acceptance, commit.

:meth:`Verifier.verify` loads each item's session from Redis (the source of truth), answers what it can
without the model (stale, finished, replayed), runs one padded pass over every session's missing tokens,
pending token and proposal on the model thread, decides each row with :mod:`specserve.core.verification`,
settles each cache on its verdict and commits every verdict with one compare-and-set. Each item fails or
succeeds alone. The order of the steps, why each is so, and what a call of several target steps does:
docs/design.md, "The verify call".
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from specserve.api.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    SessionFinished,
    SpecServeError,
    VersionConflict,
)
from specserve.api.params import FINISH_REASONS, NOT_FINISHED, PositionLogprobs, Verdict
from specserve.core import features as feature_wire
from specserve.core.features import FeatureBlock
from specserve.core.proposal import DraftProposal
from specserve.core.sampling import (
    greedy_tokens,
    logits_to_probs,
    pick_logprobs,
    processed_logprobs,
    suppress_tokens,
)
from specserve.core.tree_verification import verify_tree, verify_tree_coupled, verify_tree_greedy
from specserve.core.verification import VerifyOutcome, verify_batch, verify_coupled, verify_greedy
from specserve.engine import batching, position_invariant
from specserve.engine.grammar import Prepared, SessionGrammars, apply_masks
from specserve.engine.kvcache import SessionCache, SessionCacheStore, common_prefix_len
from specserve.engine.model_thread import ModelThread
from specserve.engine.models import LoadedModel
from specserve.runtime import metrics
from specserve.runtime.store import SessionRecord, SessionSettings, SessionStore
from specserve.target.calibration import measure_verify_curve
from specserve.target.messages import BatchResult, ItemResult, ItemToVerify, VerifyBatch
from specserve.target.stops import cut_at_stop

log = structlog.get_logger(__name__)

_NO_PROPOSAL = DraftProposal(token_ids=())


@dataclass
class _ItemState:
    """One item on its way through a call (mutable bookkeeping, internal)."""

    index: int  # position in the request
    item: ItemToVerify
    record: SessionRecord
    cache: SessionCache | None = None
    feed: tuple[int, ...] = ()  # tokens fed in the verify pass: catch-up + pending + proposal
    logits: torch.Tensor | None = None  # [gamma + 1, vocab] float32: p_1..p_{gamma+1} before processing
    probs: torch.Tensor | None = None  # [gamma + 1, vocab] float64: p_1..p_{gamma+1} after processing
    choices: torch.Tensor | None = None  # [gamma + 1] int64: greedy rows' argmax tokens
    outcome: VerifyOutcome | None = None
    verdict: Verdict | None = None
    error: SpecServeError | None = None  # this item's own failure: nothing is committed for it
    steps_taken: int = 1  # target steps taken for the item in this call (of its decode_steps)
    features: FeatureBlock | None = None  # what the item asked for (features_from), once its cache settled
    cached: int = 0  # committed tokens this call attached from the prefix cache instead of feeding them
    grammar: Any = None  # its constraint's compiled grammar (or why it does not compile), from _prepare_grammars
    #: A draft tree's nodes' keys/values from the pass (per layer ``[1, kv_heads, nodes, head_dim]``), kept aside
    #: until the verdict says which path stays (:meth:`Verifier._keep_path`); and their features, when tracked.
    tree_kv: Any = None
    tree_features: torch.Tensor | None = None
    #: A draft tree's accepted path (node indices); after the decision ``logits`` / ``probs`` hold its rows only.
    path: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        return self.record.committed_len

    @property
    def proposed(self) -> tuple[int, ...]:
        """The proposal as a chain: a chain's tokens; a tree's accepted path's, once decided."""
        if self.path is None:
            return self.item.proposal.token_ids
        tree = self.item.tree
        assert tree is not None
        return tuple(tree.tokens[v] for v in self.path)

    def fail(self, exc: SpecServeError) -> None:
        """Mark this item failed with ``exc`` (its message prefixed with the session)."""
        self.error = type(exc)(f"session {self.item.session_id!r}: {exc.message}")

    def next_step(self) -> _ItemState:
        """The item's next target step (``decode_steps``): the work a gamma = 0 round would do on the log as
        this call's verdict so far leaves it (same version: it is one commit). An item that came with a
        proposal had it verified in the first step; the steps after it propose nothing."""
        assert self.verdict is not None and self.cache is not None
        record = dataclasses.replace(
            self.record, token_ids=self.record.token_ids + self.verdict.committed_token_ids
        )
        plain = dataclasses.replace(self.item, proposal=_NO_PROPOSAL, tree=None)
        return _ItemState(index=self.index, item=plain, record=record, grammar=self.grammar)

    def goes_on(self) -> bool:
        """Whether the item takes another target step in this call: committed so far, not finished,
        steps left."""
        return (
            self.steps_taken < self.item.decode_steps
            and self.error is None
            and self.verdict is not None
            and not self.verdict.finished
        )

    def absorb(self, step: _ItemState) -> None:
        """Extend this item's verdict by its next step's (one commit of all the steps' tokens). A step that
        failed alone ends the item's steps: the ones before it are committed."""
        assert self.verdict is not None
        self.steps_taken += 1
        verdict = step.verdict
        if verdict is None:
            assert step.error is not None
            log.warning("decode_step_failed", session_id=self.item.session_id, message=step.error.message)
            self.steps_taken = self.item.decode_steps
            return
        self.verdict = dataclasses.replace(
            verdict,
            accepted_count=self.verdict.accepted_count,
            committed_token_ids=self.verdict.committed_token_ids + verdict.committed_token_ids,
            bonus=self.verdict.bonus,
            logprobs=self.verdict.logprobs + verdict.logprobs,
        )


class Verifier:
    """Verifies batches of proposals against the target model and commits them (docs/design.md)."""

    def __init__(
        self,
        model: LoadedModel,
        caches: SessionCacheStore,
        store: SessionStore,
        *,
        inline_catchup_max: int = 32,
        thread: ModelThread | None = None,
        features_per_call_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        if features_per_call_bytes < 1:
            raise ValueError(f"features_per_call_bytes must be >= 1, got {features_per_call_bytes}")
        self.model = model
        self.caches = caches
        self.store = store
        self.inline_catchup_max = inline_catchup_max
        #: Most bytes of features one reply carries, all its items together (at least one row).
        self.features_per_call_bytes = features_per_call_bytes
        self.eos_token_ids = _eos_token_ids(model)
        self.max_positions = model.max_positions
        #: Constrained sessions' matchers, beside their caches (built from the committed tokens when missing).
        self.grammars = SessionGrammars(
            model.tokenizer, model.vocab_size, self.eos_token_ids, max_sessions=2 * caches.max_sessions
        )
        #: Each recent session's settings (immutable after create), most recently used last.
        self._settings: OrderedDict[str, SessionSettings] = OrderedDict()
        self._settings_max = 2 * caches.max_sessions
        #: Each session's log as of this replica's last commit to it (a hint; the commit's CAS decides).
        self._known: OrderedDict[str, SessionRecord] = OrderedDict()
        self._lock = asyncio.Lock()
        self.thread = thread or ModelThread("target-model")
        #: One session's pass for 1, 2, ... positions (ns), once :meth:`measure_cost` ran; else empty.
        self.verify_curve_ns: tuple[int, ...] = ()

    async def measure_cost(self, max_positions: int) -> tuple[int, ...]:
        """Measure :attr:`verify_curve_ns` on the model thread (before the server takes calls)."""
        self.verify_curve_ns = await self.thread.run(measure_verify_curve, self.model, max_positions)
        log.info("verify_cost_measured", ms=[round(t / 1e6, 2) for t in self.verify_curve_ns])
        return self.verify_curve_ns

    def close(self) -> None:
        """Stop the model thread after the call in flight, and the grammars' preparing threads."""
        self.thread.close(wait=True)
        self.grammars.close()

    async def verify(self, batch: VerifyBatch) -> BatchResult:
        """Verify and commit every item of ``batch``; per-session problems become per-item errors."""
        task = asyncio.ensure_future(self._verify(batch))
        return await asyncio.shield(task)

    async def idle(self) -> None:
        """Return once no batch is in flight (for a graceful drain)."""
        async with self._lock:
            pass

    async def release(self, session_id: str) -> None:
        """Drop a session's cache; NotFound when this replica holds none."""
        async with self._lock:
            await self.thread.run(self._release, session_id)
        log.info("session_released", session_id=session_id, reason="request")

    def _release(self, session_id: str) -> None:
        self.thread.check()
        self._settings.pop(session_id, None)
        self._known.pop(session_id, None)
        self.grammars.drop(session_id)
        self.caches.release(session_id)
        self._update_cache_gauges()

    async def _verify(self, batch: VerifyBatch) -> BatchResult:
        start = time.perf_counter_ns()
        loaded, grammars = await self._prepare_grammars(batch)
        async with self._lock:
            records = await asyncio.gather(
                *(self._record(item, loaded.get(item.session_id)) for item in batch.items)
            )
            results: list[ItemResult | None] = [None] * len(batch.items)
            work: list[_ItemState] = []
            for index, (item, record) in enumerate(zip(batch.items, records, strict=True)):
                early = self._answer_without_model(item, record)
                if early is not None:
                    results[index] = early
                else:
                    assert isinstance(record, SessionRecord)
                    grammar = grammars.get(record.sampling.constraint) if record.sampling.constraint else None
                    work.append(_ItemState(index=index, item=item, record=record, grammar=grammar))
            forward_ns = positions = 0
            if work:
                try:
                    forward_ns, positions = await self.thread.run(self._compute, work)
                except BaseException:
                    await self.thread.run(self._roll_back, work)
                    raise
                commits = await asyncio.gather(*(self._commit(w) for w in work), return_exceptions=True)
                settled, undo, unexpected = self._results(work, commits)
                if undo:  # a commit was refused or replayed: its cache goes back to C[:-1]
                    await self.thread.run(self._roll_back, undo)
                if unexpected is not None:
                    raise unexpected
                for w, result in zip(work, settled, strict=True):
                    results[w.index] = result
            else:
                self._update_cache_gauges()  # a read: nothing runs on the model thread under the lock
        metrics.TARGET_POSITIONS.inc(positions)
        metrics.TARGET_FORWARD_SECONDS.observe(forward_ns / 1e9)
        assert all(r is not None for r in results)
        done = batch.in_request_order([r for r in results if r is not None])
        for r in done:
            log.debug(
                "verified",
                session_id=r.session_id,
                version=r.verdict.new_version if r.verdict else None,
                committed=len(r.verdict.committed_token_ids) if r.verdict else 0,
                error=type(r.error).__name__ if r.error else None,
            )
        return BatchResult(
            results=done,
            verify_ns=time.perf_counter_ns() - start,
            forward_ns=forward_ns,
            positions_processed=positions,
        )

    # ------------------------------------------------------------------ load / triage

    async def _prepare_grammars(
        self, batch: VerifyBatch
    ) -> tuple[dict[str, SessionRecord | SpecServeError], Prepared]:
        """The compiled grammars of the batch's sessions' constraints, taken before the lock: those the engine
        does not hold are compiled off the model thread, so a slow compile holds up this call only, not the
        batches of other calls (:meth:`SessionGrammars.prepare`); the pass gets them from here, never from a
        compile of its own. A session's settings come from memory, or from a read of its record the first
        time this replica sees it; the records read are returned too, for :meth:`_record` to use as a hint
        (the commit's compare-and-set decides, as for :attr:`_known`)."""
        unknown = list(dict.fromkeys(i.session_id for i in batch.items if i.session_id not in self._settings))
        loaded = dict(zip(unknown, await asyncio.gather(*(self._load(sid) for sid in unknown)), strict=True))
        constraints = []
        for item in batch.items:
            settings = self._settings.get(item.session_id)
            record = loaded.get(item.session_id)
            if settings is None and isinstance(record, SessionRecord):
                settings = record.settings
            constraint = settings.sampling.constraint if settings is not None else None
            if constraint is not None:
                constraints.append(constraint)
        grammars = await self.grammars.prepare(constraints) if constraints else {}
        return loaded, grammars

    async def _record(
        self, item: ItemToVerify, loaded: SessionRecord | SpecServeError | None = None
    ) -> SessionRecord | SpecServeError:
        """The session's log: what this replica committed last, or ``loaded`` (read by this call before the
        lock), when the item is based on exactly that; else a load from Redis."""
        base = item.base
        known = self._known.get(item.session_id)
        if known is not None and (known.version, known.committed_len) == (base.version, base.committed_len):
            self._known.move_to_end(item.session_id)
            return known
        if isinstance(loaded, SessionRecord) and (loaded.version, loaded.committed_len) == (
            base.version,
            base.committed_len,
        ):
            return loaded
        return await self._load(item.session_id)

    def _remember(self, w: _ItemState, verdict: Verdict) -> None:
        """After a commit of ours: the session's log is the loaded one plus this verdict."""
        self._known[w.item.session_id] = dataclasses.replace(
            w.record,
            token_ids=w.record.token_ids + verdict.committed_token_ids,
            version=verdict.new_version,
            finish_reason=verdict.finish_reason,
            last_verdict=verdict,
        )
        self._known.move_to_end(w.item.session_id)
        while len(self._known) > self._settings_max:
            self._known.popitem(last=False)

    async def _load(self, session_id: str) -> SessionRecord | SpecServeError:
        """The session's record (its settings from memory after the first load), or its own error."""
        try:
            record = await self.store.load(session_id, settings=self._settings.get(session_id))
        except (NotFound, InvalidArgument, FailedPrecondition) as exc:  # gone, or stored settings unusable
            self._settings.pop(session_id, None)
            return exc
        self._settings[session_id] = record.settings
        self._settings.move_to_end(session_id)
        while len(self._settings) > self._settings_max:
            self._settings.popitem(last=False)
        return record

    def _answer_without_model(
        self, item: ItemToVerify, record: SessionRecord | SpecServeError
    ) -> ItemResult | None:
        """A result decided without the model (error or replay), or None when the item needs work."""
        sid, base = item.session_id, item.base
        if isinstance(record, SpecServeError):
            return ItemResult(sid, error=type(record)(f"session {sid!r}: {record.message}"))
        last = record.last_verdict
        if last is not None and record.version == base.version + 1:
            if base.committed_len != last.committed_len - len(last.committed_token_ids):
                return ItemResult(
                    sid,
                    error=FailedPrecondition(
                        f"session {sid!r}: version {base.version} had "
                        f"{last.committed_len - len(last.committed_token_ids)} committed tokens, "
                        f"the request says {base.committed_len}"
                    ),
                )
            log.info("verify_replayed", session_id=sid, version=base.version)
            return ItemResult(sid, verdict=last, replayed=True)
        if record.version != base.version:
            metrics.COMMIT_CONFLICTS.labels(reason="stale_base").inc()
            return ItemResult(
                sid,
                error=VersionConflict(
                    f"session {sid!r} is at version {record.version}, the request is based on {base.version}"
                ),
            )
        if record.finished:
            return ItemResult(
                sid, error=SessionFinished(f"session {sid!r} already finished; nothing to verify")
            )
        if record.committed_len != base.committed_len:
            return ItemResult(
                sid,
                error=FailedPrecondition(
                    f"session {sid!r} holds {record.committed_len} committed tokens at version "
                    f"{record.version}, the request says {base.committed_len}"
                ),
            )
        if self.max_positions is not None and record.committed_len + item.depth > self.max_positions:
            return ItemResult(
                sid,
                error=InvalidArgument(
                    f"session {sid!r}: {record.committed_len} committed + {item.depth} proposed tokens "
                    f"exceed the target model's {self.max_positions} positions; propose at most "
                    f"{max(0, self.max_positions - record.committed_len)}"
                ),
            )
        return None

    # ------------------------------------------------------------------ model work (worker thread)

    def _compute(self, work: list[_ItemState]) -> tuple[int, int]:
        """The model work of a batch in one hop: the pass, the decision, each cache settled on its verdict
        (before the commit; :meth:`_roll_back` undoes it for an item whose commit fails), the budget."""
        forward_ns, positions = self._step(work)
        going = [w for w in work if w.goes_on()]
        while going:  # items asking for more target steps in this call (decode_steps), each at gamma = 0
            nexts = [w.next_step() for w in going]
            ns, fed = self._step(nexts)
            forward_ns, positions = forward_ns + ns, positions + fed
            for w, nxt in zip(going, nexts, strict=True):
                w.absorb(nxt)
            going = [w for w in going if w.goes_on()]
        self._features(work)
        for w in work:
            if w.cache is not None and w.error is None:
                self.caches.share(w.cache)  # its whole committed blocks, for the sessions after it
        self.caches.trim(protect=[w.item.session_id for w in work])  # the caches grew: keep the budget
        self._update_cache_gauges()
        return forward_ns, positions

    def _features(self, work: list[_ItemState]) -> None:
        """Fill ``w.features`` of the items that asked (``features_from``): positions from there (or from the
        last block of this call's prefix-cache hit, ``features_from_uncached``) up to the new pending token, which its
        cache holds after settling. The reply's rows stay within :attr:`features_per_call_bytes`, shared
        fairly (:func:`share_rows`), and each item's within its ``features_max_bytes``; an item whose rows do
        not all fit gets the first ones (the rest is asked for in its next call)."""
        asks: list[tuple[_ItemState, int, int]] = []
        for w in work:
            start = w.item.features_from
            if start is None or w.verdict is None or w.cache is None:
                continue
            if w.item.features_from_uncached:  # the draft's head may hold a block fewer of the shared history
                start = max(start, w.cached - self.caches.block_tokens)
            stop = w.verdict.committed_len - 1
            if w.cache.features_len < stop:  # not reached for a settled item: kept, not guessed
                log.warning("features_missing", session_id=w.item.session_id, held=w.cache.features_len, stop=stop)
                continue
            asks.append((w, start, stop))
        if not asks:
            return
        hidden = self.model.model.config.get_text_config(decoder=True).hidden_size
        row = hidden * feature_wire.VALUE_BYTES
        wants = []
        for w, start, stop in asks:
            own = w.item.features_max_bytes
            wants.append(stop - start if own == 0 else min(stop - start, max(1, own // row)))
        rows = share_rows(wants, max(1, self.features_per_call_bytes // row))
        for (w, start, _), n in zip(asks, rows, strict=True):
            w.features = feature_wire.encode(w.cache.feature_rows(start, start + n), start)  # type: ignore[union-attr]

    def _step(self, work: list[_ItemState]) -> tuple[int, int]:
        """One pass for ``work`` and its decision, each cache settled on its verdict; (forward_ns, positions)."""
        forward_ns, positions = self._forward(work)
        self._decide(work)
        for w in work:
            if w.tree_kv is not None:
                self._keep_path(w)
            self._keep_committed_prefix(w, w.verdict.committed_len - 1 if w.verdict is not None else w.n - 1)
        return forward_ns, positions

    def _forward(self, work: list[_ItemState]) -> tuple[int, int]:
        """Reconcile caches and run the verify pass; fills ``w.logits``. Returns (forward_ns, positions).

        An item whose cache cannot be brought to its log fails alone and is left out of the pass.
        """
        self.thread.check()
        forward_ns = positions = 0
        # A lone session's catch-up rides in its verify pass whatever its length: no padding to save, and
        # a separate prefill would cost one more pass (a step's worth of weight reads on a CPU).
        catchup_max = self.inline_catchup_max if len(work) > 1 else None
        for w in work:
            try:
                cache, _created = self.caches.get_or_create(w.item.session_id, scope=w.item.cache_scope)
                committed = w.record.token_ids
                if w.item.features_from is not None:  # before attaching: a tracking cache takes featured blocks
                    cache.track_features()
                w.cached = self.caches.attach(cache, committed, most=w.n - 1)
                keep = min(common_prefix_len(cache.tokens, committed), w.n - 1)
                if w.item.features_from is not None:  # positions without their features are fed again
                    keep = min(keep, cache.features_len)
                if catchup_max is not None and w.n - 1 - keep > catchup_max:
                    t0 = time.perf_counter_ns()
                    reconciled = cache.reconcile(committed, pending=True)  # a separate prefill pass
                    forward_ns += time.perf_counter_ns() - t0
                    positions += reconciled.fed
                    keep = w.n - 1
                else:
                    cache.truncate(keep)
                    cache.commit(cache.branch_len)
            except (InvalidArgument, FailedPrecondition) as exc:
                w.fail(exc)
                continue
            w.cache = cache
            w.feed = tuple(committed[keep:]) + w.item.proposal.token_ids
        ready = [w for w in work if w.error is None]
        if not ready:
            return forward_ns, positions
        t0 = time.perf_counter_ns()
        if len(ready) == 1 and (ready[0].item.tree is None or not position_invariant.is_invariant(self.model.model)):
            # A lone session feeds its own cache: no copy of its past into a padded batch (a tree's nodes
            # come back beside the logits and wait for the verdict; the invariant attention packs a tree).
            w = ready[0]
            assert w.cache is not None
            if w.item.tree is None:
                w.logits = w.cache.extend(w.feed, logits_to_keep=w.item.gamma + 1)  # [gamma + 1, vocab]
            else:
                w.logits, w.tree_kv, w.tree_features = w.cache.extend_tree(
                    w.feed, w.item.tree.parents, logits_to_keep=w.item.gamma + 1
                )
        else:
            rows = []
            for w in ready:
                assert w.cache is not None
                past = tuple(w.cache.layer_kv())
                rows.append(
                    batching.RowInput(
                        past=past or None,
                        past_len=w.cache.seq_len,
                        input_ids=w.feed,
                        logits_needed=w.item.gamma + 1,
                        tree=w.item.tree.parents if w.item.tree is not None else None,
                    )
                )
            packed = batching.pack(rows, config=self.model.model.config, device=self.model.device)
            tap = None
            if any(w.cache is not None and w.cache.tracks_features for w in ready):
                with self.caches.feature_maker.tap() as tap:  # what the pass's features are made of
                    logits, grown = position_invariant.forward(self.model.model, packed)
            else:
                logits, grown = position_invariant.forward(self.model.model, packed)
            for b, w in enumerate(ready):
                assert w.cache is not None
                rows_b = None
                if tap is not None and w.cache.tracks_features:
                    rows_b = tap.rows(b, len(w.feed))  # [len(feed), hidden] float32
                kv = batching.new_kv(grown, packed, b)
                if w.item.tree is not None:  # the nodes wait for the verdict: only its path stays
                    chain = len(w.feed) - w.item.tree.nodes
                    w.tree_kv = tuple((k[:, :, chain:], v[:, :, chain:]) for k, v in kv)
                    kv = tuple((k[:, :, :chain], v[:, :, :chain]) for k, v in kv)
                    if rows_b is not None:
                        w.tree_features, rows_b = rows_b[chain:], rows_b[:chain]
                    w.cache.append_kv(kv, w.feed[:chain], rows_b)
                else:
                    w.cache.append_kv(kv, w.feed, rows_b)
                w.logits = batching.row_logits(logits, packed, b)  # [gamma + 1, vocab]
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        forward_ns += time.perf_counter_ns() - t0
        positions += sum(len(w.feed) for w in ready)
        return forward_ns, positions

    def _decide(self, work: list[_ItemState]) -> None:
        """Process logits, run the acceptance rule, cut at stops; fills ``w.outcome`` and ``w.verdict``.

        A row without a distribution (NaN / inf logits) or that the acceptance rule refuses fails alone.
        """
        for w in work:
            if w.error is None:
                try:
                    self._constrain(w)
                    self._suppress_stops(w)
                    if w.record.sampling.plain_greedy:
                        # Nothing processes a plain greedy row: its argmax is the one-hot's (finite rows only).
                        assert w.logits is not None
                        w.choices = greedy_tokens(w.logits).cpu()  # [gamma + 1]
                    else:
                        w.probs = self._target_probs(w)  # [gamma + 1, vocab] float64
                except (InvalidArgument, Aborted) as exc:  # Aborted: its grammar was not prepared (_constrain)
                    w.fail(exc)
        trees = [w for w in work if w.error is None and w.item.tree is not None]
        for w in trees:
            self._decide_tree(w)
        ready = [w for w in work if w.error is None and w.item.tree is None]
        greedy = [w for w in ready if w.record.sampling.greedy]
        coupled = [w for w in ready if w.record.sampling.coupled]
        sampled = [w for w in ready if not (w.record.sampling.greedy or w.record.sampling.coupled)]
        if coupled:
            self._decide_coupled(coupled)
        if greedy:
            width = max(w.item.gamma for w in greedy) + 1
            argmax = torch.zeros((len(greedy), width), dtype=torch.int64)  # [batch, max_gamma + 1]
            for b, w in enumerate(greedy):
                if w.choices is None:  # a processed row (repetition penalty): the one-hot's argmax
                    assert w.probs is not None
                    w.choices = w.probs.argmax(dim=-1).cpu()
                argmax[b, : w.item.gamma + 1] = w.choices
            for w, outcome in zip(
                greedy, verify_greedy(argmax, [w.item.proposal for w in greedy]), strict=True
            ):
                w.outcome = outcome
        if sampled:
            try:
                outcomes = _verify_sampled(sampled)
            except InvalidArgument:
                # One row is impossible (its q contradicts its token, ...). A row's outcome does not
                # depend on its batch, so verifying each row alone gives the others the same outcome.
                for w in sampled:
                    try:
                        w.outcome = _verify_sampled([w])[0]
                    except InvalidArgument as exc:
                        w.fail(exc)
            else:
                for w, outcome in zip(sampled, outcomes, strict=True):
                    w.outcome = outcome
        for w in work:
            if w.error is None:
                w.verdict = self._verdict(w)

    def _decide_tree(self, w: _ItemState) -> None:
        """A draft tree's rule (docs/design.md, "Draft trees: exact acceptance"): greedy, coupled, or recursive
        rejection sampling without replacement; then the item reads as the chain of its accepted path (its rows
        of ``logits`` / ``probs`` only), for the verdict and the log probabilities."""
        tree = w.item.tree
        assert tree is not None and w.logits is not None
        sampling = w.record.sampling
        try:
            if sampling.greedy:
                if w.choices is None:  # a processed row (repetition penalty): the one-hot's argmax
                    assert w.probs is not None
                    w.choices = w.probs.argmax(dim=-1).cpu()
                outcome = verify_tree_greedy(w.choices, tree)
            elif sampling.coupled:
                assert w.probs is not None
                outcome = verify_tree_coupled(w.probs, tree, sampling.seed, w.n)
            else:
                assert w.probs is not None
                outcome = verify_tree(w.probs.cpu(), tree, sampling.seed, w.n)
        except InvalidArgument as exc:
            w.fail(exc)
            return
        rows = torch.tensor([0, *(v + 1 for v in outcome.path)], device=w.logits.device)
        w.path = outcome.path
        w.logits = w.logits.index_select(0, rows)  # [accepted + 1, vocab]
        if w.probs is not None:
            w.probs = w.probs.index_select(0, rows.to(w.probs.device))
        w.outcome = outcome.as_verify_outcome()

    def _keep_path(self, w: _ItemState) -> None:
        """Append the accepted path's keys/values (and features) after the pending token: the cache then holds
        what a chain of that path would have left, and the other nodes' are dropped. The path is a chain at
        consecutive positions, each node computed over the prefix and its ancestors only."""
        kv, features, w.tree_kv, w.tree_features = w.tree_kv, w.tree_features, None, None
        if not w.path or w.cache is None or w.error is not None:
            return
        index = torch.tensor(w.path, dtype=torch.int64, device=kv[0][0].device)
        path_kv = [(k.index_select(2, index), v.index_select(2, index)) for k, v in kv]
        rows = features.index_select(0, index.to(features.device)) if features is not None else None
        w.cache.append_kv(path_kv, w.proposed, rows)

    def _constrain(self, w: _ItemState) -> None:
        """A constrained session: mask each row with its grammar state (row ``i`` after ``C + x_1..x_{i-1}``),
        before any processing, as target-only constrained decoding would. The matcher walks the proposal and
        steps back to ``C``; a proposed token the grammar refuses has probability 0 and is rejected."""
        constraint = w.record.sampling.constraint
        if constraint is None:
            return
        if w.item.tree is not None:
            raise InvalidArgument(
                "a constrained session's proposal must be a chain (trees are not masked yet)"
            )
        assert w.logits is not None
        matcher = self.grammars.at(w.item.session_id, constraint, w.record.generated_token_ids, w.grammar)
        masks = matcher.masks_along(w.item.proposal.token_ids)  # [gamma + 1, words]
        w.logits = apply_masks(w.logits.clone(), masks)

    def _suppress_stops(self, w: _ItemState) -> None:
        """``min_new_tokens``: mask the stop tokens out of the rows that emit a token before the minimum
        (row ``i`` emits generated token ``n - prompt_len + i``), before any processing, as target-only
        decoding would; the verdict, its logprobs and the acceptance rule all read the masked rows."""
        assert w.logits is not None
        stop = w.record.stop
        tree = w.item.tree
        levels = w.logits.shape[0] if tree is None else tree.max_depth + 1
        rows = stop.masked_rows(w.n - w.record.prompt_len, levels)
        if rows and tree is not None:  # a tree's row emits at its depth: mask the rows of the first levels
            order = torch.tensor([0, *tree.depths]).argsort(stable=True).to(w.logits.device)  # by depth
            first = sum(1 for d in (0, *tree.depths) if d < rows)
            masked = suppress_tokens(w.logits[order], stop.stop_tokens(self.eos_token_ids), first)
            w.logits = masked[order.argsort()]
        elif rows:
            w.logits = suppress_tokens(w.logits, stop.stop_tokens(self.eos_token_ids), rows)

    def _logprobs(self, w: _ItemState, token_ids: tuple[int, ...]) -> tuple[PositionLogprobs, ...]:
        """The committed tokens' log probabilities, when the item asked for them (else ``()``)."""
        if w.item.top_logprobs is None or not token_ids:
            return ()
        assert w.logits is not None
        rows = w.logits[: len(token_ids)]  # [kept, vocab]: token i was emitted from p_{i+1}
        contexts = None
        if w.record.sampling.repetition_penalty != 1.0:
            contexts = [w.record.token_ids + token_ids[:i] for i in range(len(token_ids))]
        logprobs = processed_logprobs(rows, w.record.sampling, contexts)  # [kept, vocab] float64
        return pick_logprobs(logprobs, token_ids, w.item.top_logprobs)

    def _decide_coupled(self, coupled: list[_ItemState]) -> None:
        """The coupled rule for ``coupled`` (sampled sessions in the coupled mode), on the model's device.

        It needs no q and cannot refuse a proposal (any token ids are a valid guess).
        """
        width = max(w.item.gamma for w in coupled) + 1
        first = coupled[0].probs
        assert first is not None
        target = torch.zeros(
            (len(coupled), width, first.shape[-1]), dtype=torch.float64, device=first.device
        )  # [batch, max_gamma + 1, vocab]
        for b, w in enumerate(coupled):
            assert w.probs is not None
            target[b, : w.item.gamma + 1] = w.probs
        outcomes = verify_coupled(
            target,
            [DraftProposal(token_ids=w.item.proposal.token_ids) for w in coupled],  # q is not read
            [w.record.sampling.seed for w in coupled],
            [w.n for w in coupled],
        )
        for w, outcome in zip(coupled, outcomes, strict=True):
            w.outcome = outcome

    def _target_probs(self, w: _ItemState) -> torch.Tensor:
        """``p_1..p_{gamma+1}``: ``[gamma + 1, vocab]`` float64, processed as target-only decoding would."""
        assert w.logits is not None
        committed, proposal = w.record.token_ids, w.item.proposal.token_ids
        contexts = None
        tree = w.item.tree
        if w.record.sampling.repetition_penalty != 1.0 and tree is not None:  # row i + 1: after node i's path
            paths = [tuple(tree.tokens[v] for v in tree.path(i)) for i in range(tree.nodes)]
            contexts = [committed, *(committed + path for path in paths)]
        elif w.record.sampling.repetition_penalty != 1.0:
            contexts = [committed + proposal[:i] for i in range(len(proposal) + 1)]
        return logits_to_probs(w.logits, w.record.sampling, contexts)

    def _verdict(self, w: _ItemState) -> Verdict:
        assert w.outcome is not None
        accepted = w.outcome.accepted
        new_tokens = (*w.proposed[:accepted], w.outcome.next_token)
        cut = cut_at_stop(
            new_tokens,
            completion_token_ids=w.record.generated_token_ids,
            stop=w.record.stop,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self.model.tokenizer,
        )
        tokens, reason = cut.token_ids, cut.finish_reason
        if self.max_positions is not None:
            room = self.max_positions - w.n  # tokens the log may still take
            if len(tokens) > room or (len(tokens) == room and reason == NOT_FINISHED):
                tokens, reason = tokens[: max(room, 0)], FINISH_REASONS["length"]
        kept = len(tokens)
        return Verdict(
            accepted_count=min(accepted, kept),
            committed_token_ids=tokens,
            bonus=w.outcome.bonus and kept == accepted + 1,
            new_version=w.record.version + 1,
            committed_len=w.n + kept,
            finish_reason=reason,
            logprobs=self._logprobs(w, tokens),
        )

    def _keep_committed_prefix(self, w: _ItemState, length: int) -> None:
        """Leave ``w``'s cache holding its first ``length`` tokens, all committed, and a constrained session's
        matcher the generated tokens up to the pending one (``length + 1`` tokens of the log)."""
        constraint = w.record.sampling.constraint
        if constraint is not None and w.item.session_id in self.grammars:
            log_tokens = w.record.token_ids + (w.verdict.committed_token_ids if w.verdict is not None else ())
            try:
                self.grammars.at(w.item.session_id, constraint, log_tokens[w.record.prompt_len : length + 1])
            except InvalidArgument:  # dropped: rebuilt from the log when the session is next verified
                log.warning("grammar_settle_failed", session_id=w.item.session_id)
        if w.cache is None:
            return
        w.cache.truncate(min(length, w.cache.seq_len))
        w.cache.commit(w.cache.branch_len)

    def _roll_back(self, work: Sequence[_ItemState]) -> None:
        self.thread.check()
        for w in work:
            self._keep_committed_prefix(w, w.n - 1)

    def _results(
        self, work: list[_ItemState], outcomes: Sequence[object]
    ) -> tuple[list[ItemResult], list[_ItemState], BaseException | None]:
        """Each item's result from its commit outcome (``(verdict, replayed)`` or the exception it raised).

        Returns the results, the items whose cache must go back to ``C[:-1]`` (their optimistic
        settling is undone: the commit was refused, replayed, or failed), and the first unexpected
        exception (then every item goes back).
        """
        results: list[ItemResult] = []
        undo: list[_ItemState] = []
        unexpected: BaseException | None = None
        for w, outcome in zip(work, outcomes, strict=True):
            sid = w.item.session_id
            if w.error is not None:  # already settled at C[:-1]
                log.info("item_refused", session_id=sid, error=type(w.error).__name__, message=w.error.message)
                results.append(ItemResult(sid, error=w.error))
                continue
            if isinstance(outcome, BaseException) or outcome[1]:  # failed, or another call committed first
                undo.append(w)
                self._known.pop(sid, None)
            if isinstance(outcome, (NotFound, FailedPrecondition, Aborted)):
                reason = type(outcome).__name__
                metrics.COMMIT_CONFLICTS.labels(reason=reason).inc()
                log.info("commit_refused", session_id=sid, reason=reason, message=outcome.message)
                results.append(ItemResult(sid, error=outcome))
            elif isinstance(outcome, BaseException):
                unexpected = unexpected or outcome
            else:
                verdict, replayed = outcome
                if not replayed:
                    self._remember(w, verdict)
                # A replayed verdict may differ from what this call settled on: no features with it.
                results.append(
                    ItemResult(
                        sid,
                        verdict=verdict,
                        replayed=replayed,
                        features=None if replayed else w.features,
                        cached_tokens=0 if replayed else w.cached,
                    )
                )
        if unexpected is not None:
            return results, list(work), unexpected
        return results, undo, None

    # ------------------------------------------------------------------ commit

    async def _commit(self, w: _ItemState) -> tuple[Verdict, bool] | None:
        if w.error is not None:
            return None  # the item failed before a verdict: nothing to commit
        assert w.verdict is not None
        start = time.perf_counter()
        try:
            return await self.store.commit(w.item.session_id, w.item.base.version, w.verdict)
        finally:
            metrics.COMMIT_SECONDS.observe(time.perf_counter() - start)

    def _update_cache_gauges(self) -> None:
        metrics.CACHED_SESSIONS.labels(role="target").set(len(self.caches))
        metrics.KV_CACHE_BYTES.labels(role="target").set(self.caches.total_bytes)


def share_rows(wants: Sequence[int], budget: int) -> list[int]:
    """Rows of features each item gets from a reply's ``budget`` rows, for ``wants`` rows asked: every item
    its ask or an equal share of what the smaller asks leave (max-min fairness), so one long prompt's
    features never crowd out its batch-mates' and the reply stays within the budget."""
    out = [0] * len(wants)
    left = budget
    order = sorted(range(len(wants)), key=lambda i: wants[i])
    for k, i in enumerate(order):
        out[i] = min(wants[i], left // (len(order) - k))
        left -= out[i]
    for i in order[::-1]:  # rounding leaves fewer rows than items: the largest asks take one each
        if left <= 0:
            break
        if out[i] < wants[i]:
            out[i] += 1
            left -= 1
    return out


def _verify_sampled(sampled: Sequence[_ItemState]) -> list[VerifyOutcome]:
    """:func:`verify_batch` over the sampled items' ``p`` rows and proposals."""
    width = max(w.item.gamma for w in sampled) + 1
    vocab = sampled[0].probs.shape[-1] if sampled[0].probs is not None else 0
    target = torch.zeros((len(sampled), width, vocab), dtype=torch.float64)  # [batch, max_gamma + 1, vocab]
    for b, w in enumerate(sampled):
        assert w.probs is not None
        target[b, : w.item.gamma + 1] = w.probs.cpu()
    return verify_batch(
        target,
        [_on_cpu(w.item.proposal) for w in sampled],
        [w.record.sampling.seed for w in sampled],
        [w.n for w in sampled],
    )


def _on_cpu(proposal: DraftProposal) -> DraftProposal:
    if proposal.probs is None or proposal.probs.device.type == "cpu":
        return proposal
    return DraftProposal(token_ids=proposal.token_ids, probs=proposal.probs.cpu())


def _eos_token_ids(model: LoadedModel) -> frozenset[int]:
    ids: set[int] = set()
    if model.eos_token_id is not None:
        ids.add(int(model.eos_token_id))
    configured = getattr(getattr(model.model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(t) for t in configured)
    return frozenset(ids)
