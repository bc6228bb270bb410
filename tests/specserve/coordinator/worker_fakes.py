"""In-process fakes of the coordinator's workers and store, for unit tests of ``WorkerPool`` and ``RoundLoop``.

Each is named as a fake and implements only the small interface its user calls:

* :class:`FakeTarget` (``TargetClient``'s: ``endpoint``, ``verify``, ``release``, ``close``) verifies greedily
  against a fixed "model", :func:`next_token`, and commits through a :class:`FakeStore` with the real
  store's compare-and-set rule, so a stale item is refused with ``VersionConflict`` (ABORTED) and a retried
  ``(session, version)`` gets the recorded verdict back (``replayed``).
* :class:`FakeDraft` (``DraftClient``'s: ``endpoint``, ``propose_one``, ``propose_batch``, ``release``,
  ``close``) keeps what each session sent it, refuses a partial resend of a session it lacks with
  ``FailedPrecondition`` as the real draft does, and proposes what its ``model`` predicts (by default the
  target's own tokens, so every proposed token is accepted).
* :class:`FakeStore` (``SessionStore``'s ``create``, ``load``, ``commit``): the committed logs in a dict.

Faults are scripted: ``fail_next`` makes the next calls raise (a whole call's failure) and ``refuse_next``
makes the next items fail alone (an item's error in a reply that succeeded). Every call is recorded in
``calls``. No timing, no sockets: what these tests check is what the pool and the round loop decide.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from specserve.api import errors
from specserve.api.params import PositionLogprobs, SamplingParams, StopConditions, Verdict
from specserve.coordinator.fleet.clients import DraftCall, ProposeBatchReply, VerifyReply, WorkerClients
from specserve.coordinator.fleet.pool import WorkerPool
from specserve.coordinator.messages import Proposal, Verified, VerifyRequest
from specserve.coordinator.requests import GenerationRequest, SpeculationSettings
from specserve.coordinator.round import RoundLoop
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.acceptance import AcceptanceMemory
from specserve.coordinator.speculation.cost_model import CostModel
from specserve.coordinator.speculation.policy import FixedGamma, SpeculationPolicy
from specserve.coordinator.speculation.speculator import Speculator
from specserve.runtime.config import CoordinatorSettings
from specserve.runtime.store import SessionRecord
from specserve.v1 import common_pb2

VOCAB = 50


def next_token(tokens: Sequence[int]) -> int:
    """The fake target's greedy "model": a fixed function of the last token."""
    return (tokens[-1] * 7 + 3) % VOCAB


def continuation(prompt: Sequence[int], n: int) -> list[int]:
    """The ``n`` tokens the fake target generates after ``prompt`` (what every session must stream)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def wrong_token(tokens: Sequence[int]) -> int:
    """A draft "model" that is never right (its every proposed token is rejected)."""
    return (next_token(tokens) + 1) % VOCAB


@dataclass
class _Log:
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    stop: StopConditions
    version: int = 0
    finish_reason: int = 0
    last_base: int = -1
    last_verdict: Verdict | None = None


class FakeStore:
    """A stand-in for ``SessionStore`` (create, load, commit), named as such: each session's log in a dict."""

    def __init__(self) -> None:
        self._logs: dict[str, _Log] = {}

    async def create(
        self, session_id: str, prompt: Sequence[int], sampling: SamplingParams, stop: StopConditions
    ) -> SessionRecord:
        self._logs[session_id] = _Log(list(prompt), len(prompt), sampling, stop)
        return await self.load(session_id)

    async def load(self, session_id: str) -> SessionRecord:
        return self.record(session_id)

    def record(self, session_id: str) -> SessionRecord:
        """``load`` without the await (the fake target reads the log it verifies on)."""
        log = self._logs.get(session_id)
        if log is None:
            raise errors.NotFound(f"session {session_id!r} does not exist")
        return SessionRecord(
            session_id=session_id,
            token_ids=tuple(log.tokens),
            prompt_len=log.prompt_len,
            version=log.version,
            sampling=log.sampling,
            stop=log.stop,
            finish_reason=log.finish_reason,
            last_verdict=log.last_verdict,
        )

    def delete(self, session_id: str) -> None:
        del self._logs[session_id]

    def commit(self, session_id: str, base_version: int, verdict: Verdict) -> tuple[Verdict, bool]:
        """The real store's rule: append iff at ``base_version``; the recorded verdict for a retried base."""
        log = self._logs.get(session_id)
        if log is None:
            raise errors.NotFound(f"session {session_id!r} does not exist")
        if log.version == base_version + 1 and log.last_base == base_version:
            assert log.last_verdict is not None
            return log.last_verdict, True
        if log.version != base_version:
            raise errors.VersionConflict(
                f"session {session_id!r} is at version {log.version}, not {base_version}"
            )
        if log.finish_reason:
            raise errors.SessionFinished(f"session {session_id!r} already finished")
        log.tokens.extend(verdict.committed_token_ids)
        log.version, log.last_base, log.last_verdict = base_version + 1, base_version, verdict
        log.finish_reason = verdict.finish_reason
        return verdict, False


class _Scripted:
    """Scripted faults and a record of calls, shared by both fake workers."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.calls: list[list[tuple]] = []
        self.released: list[str] = []
        self._failures: list[Exception] = []
        self._refusals: list[errors.SpecServeError] = []

    def fail_next(self, *excs: Exception) -> None:
        """The next ``len(excs)`` calls fail as a whole, raising these in order."""
        self._failures.extend(excs)

    def refuse_next(self, *refusals: errors.SpecServeError) -> None:
        """The next ``len(refusals)`` items (of calls that succeed) fail alone with these errors, in order."""
        self._refusals.extend(refusals)

    def _maybe_fail(self) -> None:
        if self._failures:
            raise self._failures.pop(0)

    def _refusal(self) -> errors.SpecServeError | None:
        return self._refusals.pop(0) if self._refusals else None

    async def release(self, session_id: str) -> bool:
        self.released.append(session_id)
        return True

    async def close(self) -> None:
        pass


class FakeTarget(_Scripted):
    """A stand-in for ``TargetClient``, named as such: greedy verification against :func:`next_token`,
    commits through a :class:`FakeStore`. ``calls``: per Verify call, ``(session_id, version, proposal)``
    of each item."""

    def __init__(self, endpoint: str, store: FakeStore) -> None:
        super().__init__(endpoint)
        self.store = store

    async def verify(self, items: Sequence[VerifyRequest]) -> VerifyReply:
        self.calls.append([(i.base.session_id, i.base.version, tuple(i.proposal.token_ids)) for i in items])
        self._maybe_fail()
        results = []
        for item in items:
            refusal = self._refusal()
            if refusal is not None:
                results.append(Verified(item, error=refusal))
                continue
            try:
                verdict, replayed = self.store.commit(
                    item.base.session_id, item.base.version, self._verdict(item)
                )
            except errors.SpecServeError as exc:
                results.append(Verified(item, error=exc))
            else:
                results.append(Verified(item, verdict, replayed=replayed))
        positions = sum(len(i.proposal.token_ids) + 1 for i in items)
        return VerifyReply(
            results=tuple(results), verify_ns=1_000, forward_ns=500, positions_processed=positions
        )

    def _verdict(self, item: VerifyRequest) -> Verdict:
        """The greedy verdict on the session's log as the store holds it (a stale base is the store's to refuse)."""
        record = self.store.record(item.base.session_id)
        tokens = list(record.token_ids[: item.base.committed_len])
        proposal = list(item.proposal.token_ids)
        left = record.stop.max_new_tokens - (len(tokens) - record.prompt_len)
        committed: list[int] = []
        accepted = 0
        for token in proposal:
            if token != next_token(tokens + committed):
                break
            committed.append(token)
            accepted += 1
        for _ in range(max(1, item.decode_steps)):  # the proposal's correction or bonus, then gamma-0 steps
            committed.append(next_token(tokens + committed))
        committed = committed[:left]
        logprobs = (
            tuple(PositionLogprobs(token_id=t, logprob=-0.5) for t in committed)
            if item.top_logprobs is not None
            else ()
        )
        return Verdict(
            accepted_count=min(accepted, len(committed)),
            committed_token_ids=tuple(committed),
            bonus=accepted == len(proposal),
            new_version=item.base.version + 1,
            committed_len=len(tokens) + len(committed),
            finish_reason=common_pb2.FINISH_REASON_LENGTH if len(committed) == left else 0,
            logprobs=logprobs,
        )


class FakeDraft(_Scripted):
    """A stand-in for ``DraftClient``, named as such: proposes ``model``'s tokens (point masses) after what
    each session sent it. ``calls``: per Propose or ProposeBatch call, ``(session_id, start_position, gamma)``
    of each request."""

    def __init__(self, endpoint: str, *, model: Callable[[Sequence[int]], int] = next_token) -> None:
        super().__init__(endpoint)
        self.model = model
        self.history: dict[str, list[int]] = {}

    def forget(self, session_id: str) -> None:
        """Lose the session (a restart): the next partial resend is refused with FailedPrecondition."""
        self.history.pop(session_id, None)

    async def propose_one(self, request: DraftCall, *, timeout_s: float | None = None) -> Proposal:
        self.calls.append([_propose_call(request)])
        self._maybe_fail()
        refusal = self._refusal()
        if refusal is not None:
            raise refusal
        return self._propose(request)

    async def propose_batch(
        self, requests: Sequence[DraftCall], *, timeout_s: float | None = None
    ) -> ProposeBatchReply:
        self.calls.append([_propose_call(r) for r in requests])
        self._maybe_fail()
        results: list[Proposal | errors.SpecServeError] = []
        for request in requests:
            refusal = self._refusal()
            if refusal is None:
                try:
                    results.append(self._propose(request))
                    continue
                except errors.SpecServeError as exc:
                    refusal = exc
            results.append(refusal)
        return ProposeBatchReply(results=tuple(results), draft_ns=1_000)

    def _propose(self, request: DraftCall) -> Proposal:
        sid = request.base.session_id
        known = self.history.get(sid, [])
        if request.start_position > len(known):
            raise errors.FailedPrecondition(
                f"the draft lacks the tokens of {sid} before {request.start_position}"
            )
        tokens = known[: request.start_position] + list(request.token_ids)
        self.history[sid] = tokens
        proposal = []
        for _ in range(request.gamma):
            proposal.append(self.model(tokens + proposal))
        return Proposal(tuple(proposal), draft_ns=1_000)


def _propose_call(request: DraftCall) -> tuple[str, int, int]:
    return (request.base.session_id, request.start_position, request.gamma)


@dataclass
class Workers:
    """A real ``WorkerPool`` over fake replicas, and the fakes it holds."""

    pool: WorkerPool
    store: FakeStore
    targets: dict[str, FakeTarget]
    drafts: dict[str, FakeDraft]


@contextlib.asynccontextmanager
async def pool_of_fakes(
    *, targets: int = 2, drafts: int = 1, max_batch_size: int = 1, draft_max_batch_size: int = 1, **settings
) -> AsyncIterator[Workers]:
    """A ``WorkerPool`` with ``targets`` fake target replicas and ``drafts`` fake draft replicas, closed on exit.

    Breakers stay open for a minute once opened (the tests see each opening), and a batch waits (up to
    30 s) for every session bound to its replica, so sessions verified or drafted together share a call."""
    store = FakeStore()
    fake_targets = {f"target-{i}:1": FakeTarget(f"target-{i}:1", store) for i in range(targets)}
    fake_drafts = {f"draft-{i}:1": FakeDraft(f"draft-{i}:1") for i in range(drafts)}
    config = CoordinatorSettings(
        host="127.0.0.1",
        target_endpoints=list(fake_targets),
        draft_endpoints=list(fake_drafts),
        max_batch_size=max_batch_size,
        max_batch_wait_ms=30_000,
        draft_batch_wait_ms=30_000,
        target_backoff_s=60,
        target_max_backoff_s=60,
        draft_backoff_s=60,
        draft_max_backoff_s=60,
        # Homes follow the session id, unbounded: the tests pick a session's home by its id (new_session).
        **{"route_prefix_tokens": 0, "route_load_factor": 1e6, **settings},
    )
    clients = WorkerClients(drafts=fake_drafts, targets=fake_targets)
    pool = WorkerPool(
        config, CostModel(), clients, max_batch_size=max_batch_size, draft_max_batch_size=draft_max_batch_size
    )
    try:
        yield Workers(pool, store, fake_targets, fake_drafts)
    finally:
        await pool.close()


_ids = itertools.count()


async def new_session(
    workers: Workers,
    *,
    home: str | None = None,
    prompt: Sequence[int] = (5, 6, 7, 8),
    max_new_tokens: int = 16,
    gamma: int | None = 3,
    top_logprobs: int | None = None,
) -> Session:
    """A greedy session created in the fake store; ``home``: a target endpoint its id hashes to first."""
    while True:
        sid = f"fake-session-{next(_ids)}"
        if home is None or workers.pool.targets.choose(sid) == home:
            break
    sampling, stop = (
        SamplingParams(temperature=0.0),
        StopConditions(max_new_tokens=max_new_tokens, ignore_eos=True),
    )
    await workers.store.create(sid, prompt, sampling, stop)
    speculation = SpeculationSettings(gamma=gamma, proposer=common_pb2.PROPOSER_KIND_MODEL)
    return Session(sid, prompt, sampling, stop, speculation, top_logprobs=top_logprobs)


def item_for(session: Session, proposal: Sequence[int] = (), **fields) -> VerifyRequest:
    """The Verify item of the session's next round, proposing ``proposal``."""
    return VerifyRequest(session.base, Proposal(tuple(proposal)), **fields)


def speculator_for(
    session: Session,
    *,
    pool=None,
    policy: SpeculationPolicy | None = None,
    max_gamma: int = 8,
    memory: AcceptanceMemory | None = None,
    prediction: Sequence[int] | None = None,
    **settings,
) -> Speculator:
    """``session``'s speculator, built as the coordinator builds it (``prediction``: the request's; ``settings``:
    ``CoordinatorSettings`` fields, e.g. ``decode_steps``, ``overlap``, ``opt_in_sources``)."""
    request = GenerationRequest(
        tuple(session.token_ids[: session.prompt_len]),
        session.sampling,
        session.stop,
        session.speculation,
        top_logprobs=session.top_logprobs,
        prediction_token_ids=tuple(prediction) if prediction else None,
    )
    settings.setdefault("decode_steps", 1)  # one target step per call unless a test asks for more
    config = CoordinatorSettings(host="127.0.0.1", target_endpoints=["fake-target:1"], **settings)
    return Speculator.build(
        session,
        request,
        fleet=pool,
        settings=config,
        policy=policy or FixedGamma(0),
        max_gamma=max_gamma,
        memory=memory,
    )


def round_loop(session: Session, *, pool, store, **speculation) -> RoundLoop:
    """A real ``RoundLoop`` for ``session`` (``speculation``: :func:`speculator_for`'s arguments)."""
    return RoundLoop(session, speculator_for(session, pool=pool, **speculation), pool=pool, store=store)
