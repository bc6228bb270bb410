"""The batched verifier: one forward pass for many sessions' proposals, exact acceptance, commit.

Terms (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318):

``C``
    A session's committed tokens (prompt + generated) as its log in Redis
    holds them, ``n = len(C)``; ``v`` its version.
proposal ``x_1..x_gamma``
    Draft tokens after ``C``, each sampled from the draft's distribution
    ``q_i`` (a point mass when the request carries no distributions).
``p_i``
    The target's distribution of the token after ``C + x_1..x_{i-1}``, after
    the same logits processing as target-only decoding (penalties see the
    tentative prefix ``C + x[:i-1]``).
accepted
    ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``, in
    order, until the first rejection (greedy: while ``x_i == argmax p_i``).
correction / bonus
    At the first rejection the target samples a correction from
    ``norm(max(0, p_i - q_i))`` (greedy: the argmax); when every token is
    accepted it samples a bonus token from ``p_{gamma+1}``.

One call (:meth:`Verifier.verify`) for a :class:`~target_service.messages.VerifyBatch`:

1. Load every session from Redis (:class:`~specserve.store.SessionStore`),
   the source of truth: a session this replica never saw, evicted or lost is
   rebuilt from it alone (DESIGN.md invariant 5). Sessions that are unknown,
   finished, or not at the request's base version get a per-item error; a
   retried call whose verdict is already recorded gets it back
   (``replayed``) without sampling again.
2. Bring each session's cache to ``C[:-1]`` (keep the longest common prefix,
   crop the rest; ``C[-1]`` is the *pending token*), then feed every
   session's missing committed tokens, pending token and proposal in **one**
   padded forward pass (:mod:`target_service.batching`). A session missing
   more than ``inline_catchup_max`` committed tokens (a cold start, a long
   prompt) is prefilled first by its own pass (``SessionCache.reconcile``),
   so one long prompt does not pad every row. A batch of one session runs on
   its own cache, unpadded.
3. Process the logits at every position exactly as target-only decoding would
   (:func:`specserve.sampling.logits_to_probs`) and decide with
   :func:`specserve.verification.verify_batch` (sampled sessions, randomness
   keyed by session seed and position) or :func:`~specserve.verification.verify_greedy`.
4. Cut the new tokens at the first stop condition (:mod:`target_service.stops`)
   and commit through one compare-and-set on ``v`` per session. The verdict's
   ``accepted_count`` counts the draft tokens actually committed (a stop may
   cut accepted ones) and ``bonus`` holds only when the bonus token itself was
   committed.
5. Leave each cache holding exactly the committed prefix without its pending
   token: the accepted draft tokens stay cached, the rest of the branch is
   cropped; on a conflict or error the branch is rolled back to ``C[:-1]``.

Model work runs on one worker thread, one batch at a time; a batch once
started runs to the end even if the caller cancels (a retry then replays it),
so caches never see a half-done round.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from specserve import metrics
from specserve.errors import (
    Aborted,
    FailedPrecondition,
    NotFound,
    SessionFinished,
    VersionConflict,
)
from specserve.kvcache import SessionCache, SessionCacheStore, common_prefix_len
from specserve.models import LoadedModel
from specserve.params import Verdict
from specserve.sampling import logits_to_probs
from specserve.store import SessionRecord, SessionStore
from specserve.verification import DraftProposal, VerifyOutcome, verify_batch, verify_greedy
from target_service import batching
from target_service.messages import BatchResult, ItemResult, VerifyBatch, VerifyItem
from target_service.stops import cut_at_stop

log = structlog.get_logger(__name__)


@dataclass
class _Work:
    """One item on its way through a call (mutable bookkeeping, internal)."""

    index: int  # position in the request
    item: VerifyItem
    record: SessionRecord
    cache: SessionCache | None = None
    feed: tuple[int, ...] = ()  # tokens fed in the verify pass: catch-up + pending + proposal
    logits: torch.Tensor | None = None  # [gamma + 1, vocab] float32: p_1..p_{gamma+1} before processing
    outcome: VerifyOutcome | None = None
    verdict: Verdict | None = None

    @property
    def n(self) -> int:
        return self.record.committed_len


class Verifier:
    """Verifies batches of proposals against the target model and commits them (see the module docstring)."""

    def __init__(
        self,
        model: LoadedModel,
        caches: SessionCacheStore,
        store: SessionStore,
        *,
        inline_catchup_max: int = 32,
    ) -> None:
        self.model = model
        self.caches = caches
        self.store = store
        self.inline_catchup_max = inline_catchup_max
        self.eos_token_ids = _eos_token_ids(model)
        self.max_positions = _max_positions(model.model.config)
        self._lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-model")

    def close(self) -> None:
        self._executor.shutdown(wait=True)

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
            self.caches.release(session_id)
            self._update_cache_gauges()
        log.info("session_released", session_id=session_id, reason="request")

    async def _run(self, fn, *args):
        # The caller's contextvars (request_id bound by the interceptor) go along, for the logs.
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, fn, *args)

    async def _verify(self, batch: VerifyBatch) -> BatchResult:
        start = time.perf_counter_ns()
        async with self._lock:
            records = await asyncio.gather(*(self._load(item.session_id) for item in batch.items))
            results: list[ItemResult | None] = [None] * len(batch.items)
            work: list[_Work] = []
            for index, (item, record) in enumerate(zip(batch.items, records, strict=True)):
                early = self._triage(item, record)
                if early is not None:
                    results[index] = early
                else:
                    assert isinstance(record, SessionRecord)
                    work.append(_Work(index=index, item=item, record=record))
            forward_ns = positions = 0
            if work:
                try:
                    forward_ns, positions = await self._run(self._forward, work)
                    await self._run(self._decide, work)
                except BaseException:
                    await self._run(self._roll_back, work)
                    raise
                for w, result in zip(work, await self._commit_all(work), strict=True):
                    results[w.index] = result
                self.caches.trim(
                    protect=[w.item.session_id for w in work]
                )  # the caches grew: keep the budget
            self._update_cache_gauges()
        metrics.TARGET_POSITIONS.inc(positions)
        metrics.TARGET_FORWARD_SECONDS.observe(forward_ns / 1e9)
        done = tuple(r for r in results if r is not None)
        assert len(done) == len(batch.items)
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

    async def _load(self, session_id: str) -> SessionRecord | NotFound:
        try:
            return await self.store.load(session_id)
        except NotFound as exc:
            return exc

    def _triage(self, item: VerifyItem, record: SessionRecord | NotFound) -> ItemResult | None:
        """A result decided without the model (error or replay), or None when the item needs work."""
        sid, base = item.session_id, item.base
        if isinstance(record, NotFound):
            return ItemResult(sid, error=record)
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
        if self.max_positions is not None and record.committed_len + item.gamma > self.max_positions:
            return ItemResult(
                sid,
                error=FailedPrecondition(
                    f"session {sid!r}: {record.committed_len} committed + {item.gamma} proposed tokens "
                    f"exceed the target model's {self.max_positions} positions"
                ),
            )
        return None

    # ------------------------------------------------------------------ model work (worker thread)

    def _forward(self, work: list[_Work]) -> tuple[int, int]:
        """Reconcile caches and run the verify pass; fills ``w.logits``. Returns (forward_ns, positions)."""
        forward_ns = positions = 0
        for w in work:
            cache, _created = self.caches.get_or_create(w.item.session_id)
            committed = w.record.token_ids
            keep = min(common_prefix_len(cache.tokens, committed), w.n - 1)
            if w.n - 1 - keep > self.inline_catchup_max:
                t0 = time.perf_counter_ns()
                reconciled = cache.reconcile(committed, pending=True)  # a separate prefill pass
                forward_ns += time.perf_counter_ns() - t0
                positions += reconciled.fed
                keep = w.n - 1
            else:
                cache.truncate(keep)
                cache.commit(cache.branch_len)
            w.cache = cache
            w.feed = tuple(committed[keep:]) + w.item.proposal.token_ids
        t0 = time.perf_counter_ns()
        if len(work) == 1:
            w = work[0]
            assert w.cache is not None
            w.logits = w.cache.extend(w.feed)[-(w.item.gamma + 1) :]  # [gamma + 1, vocab]
        else:
            rows = []
            for w in work:
                assert w.cache is not None
                past = tuple(w.cache.layer_kv())
                rows.append(
                    batching.RowInput(
                        past=past or None,
                        past_len=w.cache.seq_len,
                        input_ids=w.feed,
                        logits_needed=w.item.gamma + 1,
                    )
                )
            packed = batching.pack(rows, config=self.model.model.config, device=self.model.device)
            logits, grown = batching.forward(self.model.model, packed)
            for b, w in enumerate(work):
                assert w.cache is not None
                w.cache.append_kv(batching.new_kv(grown, packed, b), w.feed)
                w.logits = batching.row_logits(logits, packed, b)  # [gamma + 1, vocab]
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        forward_ns += time.perf_counter_ns() - t0
        positions += sum(len(w.feed) for w in work)
        return forward_ns, positions

    def _decide(self, work: list[_Work]) -> None:
        """Process logits, run the acceptance rule, cut at stops; fills ``w.outcome`` and ``w.verdict``."""
        greedy = [w for w in work if w.record.sampling.greedy]
        sampled = [w for w in work if not w.record.sampling.greedy]
        probs = {id(w): self._target_probs(w) for w in work}  # each [gamma + 1, vocab] float64
        if greedy:
            width = max(w.item.gamma for w in greedy) + 1
            argmax = torch.zeros((len(greedy), width), dtype=torch.int64)  # [batch, max_gamma + 1]
            for b, w in enumerate(greedy):
                argmax[b, : w.item.gamma + 1] = probs[id(w)].argmax(dim=-1).cpu()
            for w, outcome in zip(
                greedy, verify_greedy(argmax, [w.item.proposal for w in greedy]), strict=True
            ):
                w.outcome = outcome
        if sampled:
            width = max(w.item.gamma for w in sampled) + 1
            vocab = probs[id(sampled[0])].shape[-1]
            target = torch.zeros(
                (len(sampled), width, vocab), dtype=torch.float64
            )  # [batch, max_gamma+1, vocab]
            for b, w in enumerate(sampled):
                target[b, : w.item.gamma + 1] = probs[id(w)].cpu()
            outcomes = verify_batch(
                target,
                [_on_cpu(w.item.proposal) for w in sampled],
                [w.record.sampling.seed for w in sampled],
                [w.n for w in sampled],
            )
            for w, outcome in zip(sampled, outcomes, strict=True):
                w.outcome = outcome
        for w in work:
            w.verdict = self._verdict(w)

    def _target_probs(self, w: _Work) -> torch.Tensor:
        """``p_1..p_{gamma+1}``: ``[gamma + 1, vocab]`` float64, processed as target-only decoding would."""
        assert w.logits is not None
        committed, proposal = w.record.token_ids, w.item.proposal.token_ids
        contexts = None
        if w.record.sampling.repetition_penalty != 1.0:
            contexts = [committed + proposal[:i] for i in range(len(proposal) + 1)]
        return logits_to_probs(w.logits, w.record.sampling, contexts)

    def _verdict(self, w: _Work) -> Verdict:
        assert w.outcome is not None
        accepted = w.outcome.accepted
        new_tokens = (*w.item.proposal.token_ids[:accepted], w.outcome.next_token)
        cut = cut_at_stop(
            new_tokens,
            completion_token_ids=w.record.generated_token_ids,
            stop=w.record.stop,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self.model.tokenizer,
        )
        kept = len(cut.token_ids)
        return Verdict(
            accepted_count=min(accepted, kept),
            committed_token_ids=cut.token_ids,
            bonus=w.outcome.bonus and kept == accepted + 1,
            new_version=w.record.version + 1,
            committed_len=w.n + kept,
            finish_reason=cut.finish_reason,
        )

    def _settle(self, w: _Work, length: int) -> None:
        """Leave ``w``'s cache holding its first ``length`` tokens, all committed."""
        if w.cache is None:
            return
        w.cache.truncate(min(length, w.cache.seq_len))
        w.cache.commit(w.cache.branch_len)

    def _roll_back(self, work: Sequence[_Work]) -> None:
        for w in work:
            self._settle(w, w.n - 1)

    # ------------------------------------------------------------------ commit

    async def _commit_all(self, work: list[_Work]) -> list[ItemResult]:
        outcomes = await asyncio.gather(*(self._commit(w) for w in work), return_exceptions=True)
        results: list[ItemResult] = []
        unexpected: BaseException | None = None
        for w, outcome in zip(work, outcomes, strict=True):
            sid = w.item.session_id
            if isinstance(outcome, (NotFound, FailedPrecondition, Aborted)):
                self._settle(w, w.n - 1)
                reason = type(outcome).__name__
                metrics.COMMIT_CONFLICTS.labels(reason=reason).inc()
                log.info("commit_refused", session_id=sid, reason=reason, message=outcome.message)
                results.append(ItemResult(sid, error=outcome))
            elif isinstance(outcome, BaseException):
                self._settle(w, w.n - 1)
                unexpected = unexpected or outcome
            else:
                verdict, replayed = outcome
                if replayed:  # another call committed this base first: our branch may differ from its verdict
                    self._settle(w, w.n - 1)
                else:
                    self._settle(w, verdict.committed_len - 1)
                results.append(ItemResult(sid, verdict=verdict, replayed=replayed))
        if unexpected is not None:
            raise unexpected
        return results

    async def _commit(self, w: _Work) -> tuple[Verdict, bool]:
        assert w.verdict is not None
        start = time.perf_counter()
        try:
            return await self.store.commit(w.item.session_id, w.item.base.version, w.verdict)
        finally:
            metrics.COMMIT_SECONDS.observe(time.perf_counter() - start)

    def _update_cache_gauges(self) -> None:
        metrics.CACHED_SESSIONS.labels(role="target").set(len(self.caches))
        metrics.KV_CACHE_BYTES.labels(role="target").set(self.caches.total_bytes)


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


def _max_positions(config) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
