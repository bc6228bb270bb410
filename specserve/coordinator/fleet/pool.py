"""The coordinator's workers: every replica, and everything a round needs from them.

One :class:`WorkerPool` per coordinator, built once from the probed limits
(:mod:`specserve.coordinator.fleet.limits`). The round loop (:mod:`specserve.coordinator.round`) asks it
for a proposal and for a verdict and never touches a replica itself:

* :meth:`WorkerPool.propose` asks the session's draft replica for up to
  ``gamma`` tokens, when :mod:`specserve.coordinator.sources` chose the draft model for the
  round (a round drafted in the coordinator makes no call:
  :meth:`WorkerPool.bind_round`). Model proposals go through the replica's
  :class:`~specserve.coordinator.fleet.batcher.ProposeBatcher`, which gathers the sessions
  drafting at the same time into one ``ProposeBatch`` call (the draft runs one
  forward pass per step for all of them); everything goes out alone when
  ``draft_max_batch_size`` is 1. Any failure leaves the round without a
  proposal (gamma = 0): a draft never fails a session. Only a replica fault
  (down, slow past ``draft_timeout_s``, a worker bug: :func:`is_replica_fault`)
  opens the draft's breaker, once per failed call; a refusal of the request
  itself (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED) is the
  session's, and the next session still gets proposals. A draft that answers
  FAILED_PRECONDITION for an item lacks earlier tokens (it lost or never had
  the session): the same request is resent once with every token from 0.
  ``propose`` depends only on the session's committed state, so a round may
  ask for its next proposal while its verify is still in flight.
* :meth:`WorkerPool.verify` sends the item through the batcher of the
  session's target replica, failing over. A constrained session's item to a
  replica that has not answered for its constraint lately goes in a call of
  its own (``ConstraintSightings``; so does a batched Propose to a draft): the
  replica compiles the constraint first, and only that call waits for it. A replica fault (UNAVAILABLE,
  DEADLINE_EXCEEDED, CANCELLED, a worker bug: :func:`is_replica_fault`) opens
  the replica's breaker, once per failed batch, and the same item, with the
  same ``(session, version)``, goes to the next replica on the session's ring;
  that replica rebuilds the session from Redis, and if the old one had
  committed before failing, answers with the recorded verdict (``replayed``).
  This is safe because a Verify is idempotent per ``(session, version)``. An
  item refused as INVALID_ARGUMENT while it carried a proposal (the proposal
  may be the draft's bug) is sent again once with an empty proposal, which
  cannot be malformed; refused without one, the problem is the session's own
  and the round returns the error. A whole call refused as INVALID_ARGUMENT is
  handled the same way. RESOURCE_EXHAUSTED is retried on the same replica. While every replica backs off the round waits
  (``all_down_wait_s``, no attempt spent) for a breaker to let a call through;
  after ``max_verify_attempts`` calls or that wait, the session fails with
  UNAVAILABLE.
* :meth:`WorkerPool.release` waits for the session's calls in flight, then
  drops its caches on every replica it used.

Around those, the pool owns:

* **replicas**: per draft endpoint a :class:`~specserve.coordinator.fleet.clients.DraftClient`
  and a :class:`~specserve.coordinator.fleet.batcher.ProposeBatcher` (every Propose leaves
  through :meth:`WorkerPool._send_propose`), per target endpoint a
  :class:`~specserve.coordinator.fleet.clients.TargetClient` and a
  :class:`~specserve.coordinator.fleet.batcher.VerifyBatcher`; the
  :class:`~specserve.coordinator.fleet.routing.ReplicaSet` of each tier (consistent hashing
  and circuit breakers, back-offs from the settings);
* **breakers**: :meth:`WorkerPool._fault` is the one place that decides
  whether a failed call counts against its replica;
* **session binding**: which target each session's next item goes to, and
  which draft batcher it drafts through (a batch waits only for sessions bound
  to its replica that are not busy elsewhere), which replicas a
  session used, and its calls in flight: each runs in a task shielded from the
  caller's cancellation, so a release never overtakes the request that would
  re-create a cache;
* **cost observations**: draft time and its round trip from each Propose,
  verify time and its round trip once per Verify call, both into the shared
  :class:`~specserve.coordinator.speculation.cost_model.CostModel`; and the load the policy sees
  (:meth:`WorkerPool.load`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import structlog

from specserve.api import errors
from specserve.coordinator.fleet.batcher import (
    BatchedResult,
    ConstraintSightings,
    ProposeBatcher,
    VerifyBatcher,
)
from specserve.coordinator.fleet.clients import ProposeReply, WorkerClients, propose_request
from specserve.coordinator.fleet.routing import ReplicaSet, prefix_key
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.acceptance import AcceptanceMemory, ProbeClock
from specserve.coordinator.speculation.cost_model import CostModel
from specserve.coordinator.speculation.policy import LoadSnapshot
from specserve.runtime import metrics
from specserve.runtime.config import CoordinatorSettings
from specserve.v1 import common_pb2, draft_pb2, target_pb2

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: How often a round waiting for a breaker (every target backing off) looks again, in seconds.
ALL_DOWN_POLL_S = 0.25
#: Proposers drafted by the draft model: a Propose call, batched. The others (n-gram) run in the coordinator.
DRAFT_PROPOSERS = frozenset(
    {common_pb2.PROPOSER_KIND_UNSPECIFIED, common_pb2.PROPOSER_KIND_MODEL, common_pb2.PROPOSER_KIND_FEATURE}
)
#: Errors that say the replica, not the request, failed: the same call may succeed on another replica.
REPLICA_FAULTS: tuple[type[errors.SpecServeError], ...] = (
    errors.Unavailable,  # WorkerError (INTERNAL, UNKNOWN, a malformed reply) included
    errors.DeadlineExceeded,
    errors.Cancelled,
)


def is_replica_fault(exc: BaseException) -> bool:
    """Whether a failed call is the replica's fault (down, hung, broken), not the request's."""
    return isinstance(exc, REPLICA_FAULTS)


def _detail(exc: BaseException) -> str:
    """What the log says of a failed worker call: the endpoint and gRPC's own details where known."""
    return getattr(exc, "detail", None) or str(exc)


@dataclass(frozen=True)
class Proposed:
    """What :meth:`WorkerPool.propose` gives a round: the proposal to verify and what drafting cost."""

    proposal: common_pb2.Proposal  # empty: the round runs at gamma = 0
    wall_ns: int = 0  # the Propose call(s) as the coordinator saw them, batching wait included (0: no call)
    draft_ns: int | None = None  # the draft's own account of its work (None: no answer)
    queue_ns: int = 0  # waiting in the coordinator for the ProposeBatch call to leave
    source: str = ""  # who drafted: "model", or a local proposer's name ("prediction", "ngram"); "": nobody

    @property
    def network_ns(self) -> int:
        """The call's time beyond the draft's own account and the wait for a batch (0 without an answer)."""
        return 0 if self.draft_ns is None else max(0, self.wall_ns - self.queue_ns - self.draft_ns)


class Verified(NamedTuple):
    """What :meth:`WorkerPool.verify` gives a round."""

    batched: BatchedResult  # the item's result and what its batch cost
    item: target_pb2.VerifyItem  # the item as last sent (an empty proposal after a refused one)


@dataclass
class _Binding:
    """What the pool knows of one session between :meth:`WorkerPool.attach` and :meth:`WorkerPool.release`."""

    attached: bool = False
    drafts_used: set[str] = field(default_factory=set)
    targets_used: set[str] = field(default_factory=set)
    inflight: set[asyncio.Task] = field(default_factory=set)
    #: The session's replica orders, fixed when it first asks (routing by prefix, bounded load).
    targets: tuple[str, ...] | None = None
    drafts: tuple[str, ...] | None = None
    homed: bool = False  # counted in the load of its orders' first replicas


class WorkerPool:
    """Every draft and target replica, and what a round needs from them (see the module docstring)."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        cost_model: CostModel,
        clients: WorkerClients,
        *,
        max_batch_size: int,
        max_in_flight: int = 1,
        draft_max_batch_size: int = 1,
    ) -> None:
        self.settings = settings
        self.cost_model = cost_model
        #: Acceptance pooled per kind of speculation across sessions: a new session's starting point.
        self.acceptance_memory = AcceptanceMemory()
        self.drafts = ReplicaSet(
            settings.draft_endpoints,
            base_backoff_s=settings.draft_backoff_s,
            max_backoff_s=settings.draft_max_backoff_s,
            name="draft",
        )
        self.targets = ReplicaSet(
            settings.target_endpoints,
            base_backoff_s=settings.target_backoff_s,
            max_backoff_s=settings.target_max_backoff_s,
            name="target",
        )
        self.draft_clients = clients.drafts
        self.draft_max_batch_size = draft_max_batch_size
        self.target_clients = clients.targets
        self.batchers = {
            ep: VerifyBatcher(
                client,
                max_batch_size=max_batch_size,
                max_wait_s=settings.max_batch_wait_ms / 1000.0,
                max_in_flight=max_in_flight,
                expected=lambda ep=ep: self._expected(ep),
            )
            for ep, client in self.target_clients.items()
        }
        self.propose_batchers = (
            {
                ep: ProposeBatcher(
                    client,
                    max_batch_size=draft_max_batch_size,
                    max_wait_s=settings.draft_batch_wait_ms / 1000.0,
                    expected=lambda ep=ep: self._expected_drafting(ep),
                    max_feature_bytes=settings.feature_bytes_per_call,
                )
                for ep, client in self.draft_clients.items()
            }
            if draft_max_batch_size > 1
            else {}
        )
        #: Per replica, the constraints it answered for lately: a constrained session's item to a replica
        #: that has not seen its constraint goes in a call of its own (the replica compiles it first).
        self.target_sightings = ConstraintSightings()
        self.draft_sightings = ConstraintSightings()
        self._bindings: dict[str, _Binding] = {}
        self._active = 0
        #: Which target each active session's next Verify item goes to, and the count per target.
        self._assigned: dict[str, str] = {}
        self._per_target = dict.fromkeys(settings.target_endpoints, 0)
        #: Which draft batcher each session drafted through last (it will again), and per draft the
        #: number of those sessions not inside a Verify (they are the ones about to submit).
        self._draft_of: dict[str, str] = {}
        self._verifying: set[str] = set()
        self._per_draft = dict.fromkeys(settings.draft_endpoints, 0)
        self._recent_batch = 1.0  # decaying mean Verify batch size
        #: Sessions whose order starts at each replica (the load that routing bounds), per tier.
        self._homes: dict[str, int] = dict.fromkeys([*settings.target_endpoints, *settings.draft_endpoints], 0)

    # ---- sessions ------------------------------------------------------------------------
    def attach(self, session: Session) -> None:
        """The session starts its rounds: it counts as active (load) until :meth:`detach`."""
        binding = self._binding(session.session_id)
        if not binding.attached:
            binding.attached = True
            self._active += 1

    def detach(self, session: Session) -> None:
        """The session will start no more rounds: stop counting it in the load and batch formation."""
        binding = self._bindings.get(session.session_id)
        if binding is not None and binding.attached:
            binding.attached = False
            self._active -= 1
        if binding is not None:
            self._home(binding, -1)
        self._bind(session.session_id, None)
        self._bind_draft(session.session_id, None)

    # ---- routing ---------------------------------------------------------------------------
    def _orders(self, session: Session) -> _Binding:
        """The session's binding with its target and draft orders, fixed on first use: the replicas its
        prompt's first tokens hash to, load bounded (``specserve/coordinator/fleet/routing.py``)."""
        binding = self._binding(session.session_id)
        if binding.targets is None:
            key = prefix_key(
                session.token_ids[: session.prompt_len], self.settings.route_prefix_tokens, session.cache_scope
            )
            key = key or session.session_id
            factor, slack = self.settings.route_load_factor, self.settings.route_load_slack
            binding.targets = self.targets.order(key, self._homes, factor=factor, slack=slack)
            binding.drafts = self.drafts.order(key, self._homes, factor=factor, slack=slack)
            self._home(binding, +1)
        return binding

    def target_for(self, session: Session) -> str | None:
        """The first target replica of the session's order that is not backing off."""
        return self.targets.first_up(self._orders(session).targets or ())

    def draft_for(self, session: Session) -> str | None:
        """The first draft replica of the session's order that is not backing off."""
        return self.drafts.first_up(self._orders(session).drafts or ())

    def draft_of(self, session_id: str) -> str | None:
        """The first draft replica of a routed session's order that is not backing off (None: not routed)."""
        binding = self._bindings.get(session_id)
        return None if binding is None or binding.drafts is None else self.drafts.first_up(binding.drafts)

    def _home(self, binding: _Binding, step: int) -> None:
        """Count the session in (+1) or out of (-1) the load of its orders' first replicas, once."""
        if binding.homed == (step > 0):
            return
        binding.homed = step > 0
        for order in (binding.targets, binding.drafts):
            if order:
                self._homes[order[0]] += step

    @property
    def active_sessions(self) -> int:
        """Sessions between :meth:`attach` and :meth:`detach`."""
        return self._active

    def bound_targets(self) -> dict[str, str]:
        """Session id -> the target its next Verify item goes to, for the sessions in a round (a copy)."""
        return dict(self._assigned)

    def drafting_sessions(self) -> dict[str, int]:
        """Per draft replica, the sessions drafting through its batcher and not inside a Verify (a copy): the
        ones its next ProposeBatch waits for."""
        return dict(self._per_draft)

    def acceptance_prior(self, key: str) -> float | None:
        """Acceptance pooled over every session's rounds under ``key`` (None: too little seen yet)."""
        return self.acceptance_memory.prior(key)

    def probe_clock(self, key: str) -> ProbeClock:
        """The probing out of gamma = 0 shared by the sessions warm-started under ``key``."""
        return self.acceptance_memory.probe_clock(key)

    def observe_acceptance(self, key: str, *, proposed: int, accepted: int) -> None:
        """One round's outcome into the pooled acceptance under ``key``."""
        self.acceptance_memory.observe(key, proposed=proposed, accepted=accepted)

    def load(self) -> LoadSnapshot:
        """How busy the target tier is now (for the policy)."""
        queued = sum(b.queued for b in self.batchers.values())
        occupancy = min(1.0, self._recent_batch / self.settings.max_batch_size)
        return LoadSnapshot(
            active_sessions=max(1, self.active_sessions), batch_occupancy=occupancy, verify_queue_depth=queued
        )

    # ---- Propose -------------------------------------------------------------------------
    def drafts_locally(self, session: Session) -> bool:
        """Whether the session's next proposal needs no draft call (no model cost: the policy's question)."""
        if session.speculation.proposer not in DRAFT_PROPOSERS:
            return True
        return any(p.ready for p in session.local_proposers)

    def bind_round(self, session: Session) -> None:
        """A round starts without a draft call (its proposal, if any, came from the coordinator,
        :mod:`specserve.coordinator.sources`): the session is bound to its target replica, whose next batch waits
        for its item, and to no draft batcher."""
        self._bind(session.session_id, self.target_for(session))
        self._bind_draft(session.session_id, None)

    async def propose(self, session: Session, gamma: int) -> Proposed:
        """Up to ``gamma`` draft tokens from the session's draft replica after its committed tokens (none:
        gamma = 0 this round, every draft replica backing off, or any failure).

        A round starts here, so the session is bound to its target replica first: that replica's next
        batch waits for its item. Which source drafts a round is :mod:`specserve.coordinator.sources`' choice; this
        is the draft model's.
        """
        sid = session.session_id
        self._bind(sid, self.target_for(session))
        endpoint = self.draft_for(session) if gamma > 0 else None
        batched = endpoint is not None and self._batched(session, endpoint)
        self._bind_draft(sid, endpoint if batched else None)
        if endpoint is None:  # gamma 0, or every draft replica is backing off
            return Proposed(common_pb2.Proposal())
        self._binding(sid).drafts_used.add(endpoint)
        start_ns = time.perf_counter_ns()
        try:
            reply = await self._propose_on(endpoint, session, gamma)
        except Exception as exc:  # any failure: this round runs at gamma = 0
            wall_ns = time.perf_counter_ns() - start_ns
            session.draft_lost()
            backoff = self._fault(self.drafts, endpoint, exc)
            (log.warning if backoff is not None else log.info)(
                "draft_fault_gamma_0" if backoff is not None else "draft_refused_gamma_0",
                session_id=sid,
                endpoint=endpoint,
                error=type(exc).__name__,
                detail=_detail(exc),
                backoff_s=backoff,
            )
            return Proposed(common_pb2.Proposal(), wall_ns=wall_ns)
        wall_ns = time.perf_counter_ns() - start_ns
        session.draft_caught_up(endpoint)
        self.drafts.mark_ok(endpoint)
        self._observe_propose(reply, wall_ns)
        if len(reply.proposal.token_ids) > gamma:
            log.error("draft_overproposed", session_id=sid, asked=gamma, got=len(reply.proposal.token_ids))
            return Proposed(common_pb2.Proposal(), wall_ns, reply.draft_ns, reply.queue_ns)
        if reply.proposal.token_ids:
            metrics.PROPOSALS.labels(proposer="model").inc()
        return Proposed(reply.proposal, wall_ns, reply.draft_ns, reply.queue_ns, source="model")

    def propose_ahead(
        self, session: Session, hypothesis: Sequence[int], gamma: int
    ) -> asyncio.Task[common_pb2.Proposal | None] | None:
        """Start drafting the round after the one in flight (overlap; None: not possible now).

        ``hypothesis`` is the in-flight proposal plus nothing else: the draft is asked for
        ``gamma + 1`` tokens after ``committed + hypothesis``, the first being its guess at the
        round's bonus token. The task's result is that proposal (None on any failure, which is
        never a fault: the round after simply drafts as usual). It goes to the draft replica the
        session's last Propose went to, unbatched, and moves no bookkeeping: the draft records the
        hypothetical tokens as the session's prefix, and the next real Propose resends every token
        after what it really saw (``Session.unseen_by_draft``), which the draft reconciles.
        """
        endpoint = session.draft_endpoint
        if (
            session.features is not None  # the head needs the target's features of the round in flight
            or endpoint is None
            or endpoint not in self.draft_clients
            or self.draft_for(session) != endpoint
        ):
            return None
        start, tokens = session.unseen_by_draft(endpoint)
        tokens = (*tokens, *hypothesis)
        base = dataclasses.replace(session.base, committed_len=start + len(tokens))
        request = _session_propose_request(session, base, start, tokens, gamma)

        async def draft() -> common_pb2.Proposal | None:
            try:
                reply = await self.draft_clients[endpoint].propose_one(request)
            except Exception as exc:  # a missed chance, not a fault
                log.debug("propose_ahead_failed", session_id=session.session_id, error=type(exc).__name__)
                return None
            return reply.proposal

        return asyncio.create_task(draft())

    def _batched(self, session: Session, endpoint: str) -> bool:
        """Whether the session's proposals go through ``endpoint``'s batcher (model proposals, batching on)."""
        return endpoint in self.propose_batchers and session.speculation.proposer in DRAFT_PROPOSERS

    async def _propose_on(self, endpoint: str, session: Session, gamma: int) -> ProposeReply:
        sid = session.session_id
        start, tokens = session.unseen_by_draft(endpoint)
        try:
            reply = await self._shielded(sid, self._send_propose(endpoint, session, start, tokens, gamma))
        except errors.FailedPrecondition:
            # The draft lacks tokens before start_position: resend everything (and the head's context).
            if session.features is not None:
                session.features.refused()
            reply = await self._shielded(sid, self._send_propose(endpoint, session, 0, session.token_ids, gamma))
        relay = session.features
        if relay is not None and reply.features_needed_from is not None:
            # The head lacks features from there: sent again at once when the relay holds them, else asked of
            # the target (the round runs at gamma 0 meanwhile).
            session.draft_caught_up(endpoint)
            if relay.needed(endpoint, reply.features_needed_from, session.committed_len):
                start, tokens = session.unseen_by_draft(endpoint)
                reply = await self._shielded(sid, self._send_propose(endpoint, session, start, tokens, gamma))
                if reply.features_needed_from is not None:
                    relay.needed(endpoint, reply.features_needed_from, session.committed_len)
        return reply

    async def _send_propose(
        self, endpoint: str, session: Session, start: int, tokens: tuple[int, ...], gamma: int
    ) -> ProposeReply:
        """The one way a Propose leaves for the draft replica at ``endpoint`` (batched or alone), with the
        target's features the replica lacks for a feature session."""
        request = _session_propose_request(session, session.base, start, tokens, gamma)
        relay = session.features
        if relay is not None:
            block, reset = relay.outgoing(endpoint, session.committed_len, self.settings.feature_bytes_per_call)
            request.features.CopyFrom(block.to_pb())
            request.features_reset = reset
        if self._batched(session, endpoint):
            constraint = session.sampling.constraint
            alone = self.draft_sightings.new_to(endpoint, constraint)
            reply = await self._through_batcher(self.propose_batchers[endpoint], request, alone=alone)
            self.draft_sightings.answered(endpoint, constraint)
        else:
            reply = await self.draft_clients[endpoint].propose_one(request)
        if relay is not None:
            relay.sent(endpoint, block)
            metrics.FEATURE_BYTES.labels(hop="to_draft").inc(len(block.data))
        return reply

    async def _through_batcher(
        self, batcher: ProposeBatcher, request: draft_pb2.ProposeRequest, *, alone: bool = False
    ) -> ProposeReply:
        """One item of a ProposeBatch call (``alone``: a call of its own): its proposal, or its own error
        raised (the call's, when it failed)."""
        batched = await batcher.submit(request, alone=alone)
        if batched.item.error is not None:
            raise batched.item.error
        assert batched.item.reply is not None
        if batched.reports_call:
            metrics.PROPOSE_BATCH_SIZE.observe(batched.batch_size)
        return dataclasses.replace(batched.item.reply, queue_ns=batched.queue_ns)

    def _observe_propose(self, reply: ProposeReply, wall_ns: int) -> None:
        n = len(reply.proposal.token_ids)
        self.cost_model.observe_draft(tokens=n, ns=reply.draft_ns, prefill_tokens=reply.prefill_tokens)
        self.cost_model.observe_rtt(
            ns=wall_ns - reply.queue_ns - reply.draft_ns, tokens=len(reply.proposal.distributions)
        )

    # ---- Verify --------------------------------------------------------------------------
    async def verify(
        self, session: Session, item: target_pb2.VerifyItem, *, drafted: bool = False
    ) -> Verified:
        """Verify ``item`` on the session's target replica, failing over (see the module docstring).

        ``drafted``: the proposal came from a Propose call in this round; with the item's wait in the
        batcher it teaches the cost model what going to the draft first costs in waiting
        (:meth:`~specserve.coordinator.speculation.cost_model.CostModel.observe_queue`)."""
        sid = session.session_id
        last_exc: Exception | None = None
        attempt = 0
        waited_s = 0.0
        while attempt < self.settings.max_verify_attempts:
            endpoint = self.target_for(session)
            if endpoint is None:
                # Every replica is backing off: wait (without spending an attempt) until a breaker
                # lets a call through, so a replica that recovers within its back-off is used.
                if waited_s >= self.settings.all_down_wait_s:
                    break
                await asyncio.sleep(ALL_DOWN_POLL_S)
                waited_s += ALL_DOWN_POLL_S
                continue
            attempt += 1
            self._binding(sid).targets_used.add(endpoint)
            self._bind(sid, endpoint)
            try:
                alone = self.target_sightings.new_to(endpoint, session.sampling.constraint)
                batched = await self._shielded(sid, self._submit_verify(sid, endpoint, item, alone=alone))
            except errors.InvalidArgument as exc:
                if not item.proposal.token_ids:
                    raise
                last_exc = exc
                item = _without_proposal(item, sid, endpoint, exc)
                continue
            except errors.ResourceExhausted as exc:
                last_exc = exc
                log.warning(
                    "verify_retry",
                    session_id=sid,
                    endpoint=endpoint,
                    detail=_detail(exc),
                    version=session.version,
                )
                await asyncio.sleep(0.05 * attempt)
                continue
            except Exception as exc:
                if self._fault(self.targets, endpoint, exc) is None:
                    raise
                last_exc = exc
                log.warning(
                    "target_failover",
                    session_id=sid,
                    endpoint=endpoint,
                    detail=_detail(exc),
                    version=session.version,
                )
                continue
            self.targets.mark_ok(endpoint)
            self.target_sightings.answered(endpoint, session.sampling.constraint)
            self._observe_verify(batched, drafted=drafted and bool(item.proposal.token_ids))
            refused = batched.item.error
            if isinstance(refused, errors.InvalidArgument) and item.proposal.token_ids:
                # The proposal may be the draft's bug: the session gets one more try without it.
                last_exc = refused
                item = _without_proposal(item, sid, endpoint, refused)
                continue
            return Verified(batched, item)
        log.warning(
            "verify_gave_up",
            session_id=sid,
            attempts=attempt,
            waited_s=waited_s,
            last_error=type(last_exc).__name__ if last_exc else None,
            detail=_detail(last_exc) if last_exc else None,
        )
        raise errors.Unavailable(
            f"no target replica could verify session {sid} after {attempt} attempts; retry shortly",
            retry_after_s=1.0,
        )

    async def _submit_verify(
        self, session_id: str, endpoint: str, item: target_pb2.VerifyItem, *, alone: bool = False
    ) -> BatchedResult:
        """One Verify attempt through the replica's batcher (``alone``: in a call of its own, for a
        constraint the replica has not seen: it compiles it first, and only this call waits).

        The session counts as verifying while it waits; it stops as soon as its result is in, before its
        round resumes: the sessions of one Verify batch all resume together, and the first of them to
        propose then waits for the others (``_expected_drafting``).
        """
        self._verifying_now(session_id, True)
        try:
            return await self.batchers[endpoint].submit(item, alone=alone)
        finally:
            self._verifying_now(session_id, False)

    def _observe_verify(self, batched: BatchedResult, *, drafted: bool) -> None:
        """Report the item's wait in the batcher, and the Verify call's cost once (through the one result
        of the call that carries it)."""
        b = batched.batch_size
        try:
            self.cost_model.observe_queue(drafted=drafted, batch_size=b, ns=batched.queue_ns)
        except Exception:  # statistics must never fail a round
            log.exception("batch_observer_failed")
        if not batched.reports_call:
            return
        try:
            # A call with several target steps ran passes one after another: not one pass over its positions.
            if batched.positions_processed >= b and batched.decode_steps == 1:
                self.cost_model.observe_verify(
                    batch_size=b, positions=batched.positions_processed, ns=batched.verify_ns
                )
            if batched.forward_ns > 0:
                self.cost_model.observe_call_overhead(ns=batched.verify_ns, forward_ns=batched.forward_ns)
            self.cost_model.observe_rtt(
                ns=batched.call_ns - batched.verify_ns, tokens=batched.draft_tokens // max(b, 1)
            )
        except Exception:  # statistics must never fail a round
            log.exception("batch_observer_failed")
        self._recent_batch = 0.9 * self._recent_batch + 0.1 * b
        metrics.VERIFY_BATCH_SIZE.observe(b)

    # ---- faults --------------------------------------------------------------------------
    def _fault(self, replicas: ReplicaSet, endpoint: str, exc: BaseException) -> float | None:
        """The one place that decides whether a failed call counts against its replica.

        Returns the replica's back-off when it counts, None when the failure is the request's own.
        A failure counts, in either tier, only when it is a replica fault (:func:`is_replica_fault`:
        down, past its deadline, a worker bug); a request's own INVALID_ARGUMENT, FAILED_PRECONDITION
        or RESOURCE_EXHAUSTED never does. It opens the breaker once per failed batch (Verify or
        ProposeBatch): the other sessions of the batch find it open already (back-off 0 here).
        """
        if not is_replica_fault(exc):
            return None
        if not replicas.is_up(endpoint):
            return 0.0
        metrics.REPLICA_FAILURES.labels(tier=replicas.name).inc()
        return replicas.mark_failed(endpoint)

    # ---- binding -------------------------------------------------------------------------
    def _binding(self, session_id: str) -> _Binding:
        return self._bindings.setdefault(session_id, _Binding())

    def _bind(self, session_id: str, endpoint: str | None) -> None:
        """Record that ``session_id``'s next Verify item goes to ``endpoint`` (None: no more items)."""
        old = self._assigned.pop(session_id, None)
        if old is not None:
            self._per_target[old] -= 1
        if endpoint is not None:
            self._assigned[session_id] = endpoint
            self._per_target[endpoint] += 1

    def _bind_draft(self, session_id: str, endpoint: str | None) -> None:
        """Record that ``session_id`` drafts through ``endpoint``'s batcher (None: not batched this round)."""
        old = self._draft_of.pop(session_id, None)
        if old is not None and session_id not in self._verifying:
            self._per_draft[old] -= 1
        if endpoint is not None:
            self._draft_of[session_id] = endpoint
            if session_id not in self._verifying:
                self._per_draft[endpoint] += 1

    def _verifying_now(self, session_id: str, verifying: bool) -> None:
        """The session enters (leaves) its Verify: it will not (will soon) submit to its draft batcher."""
        if verifying == (session_id in self._verifying):
            return
        if verifying:
            self._verifying.add(session_id)
        else:
            self._verifying.discard(session_id)
        endpoint = self._draft_of.get(session_id)
        if endpoint is not None:
            self._per_draft[endpoint] += -1 if verifying else 1

    def _expected_drafting(self, endpoint: str) -> int:
        """Sessions drafting through ``endpoint`` that are not in its batcher yet (between their rounds)."""
        batcher = self.propose_batchers[endpoint]
        return self._per_draft[endpoint] - batcher.queued - batcher.in_flight_items

    def _expected(self, endpoint: str) -> int:
        """Sessions bound to ``endpoint`` that are not in its batcher yet (drafting, or streaming)."""
        batcher = self.batchers[endpoint]
        return self._per_target[endpoint] - batcher.queued - batcher.in_flight_items

    async def _shielded(self, session_id: str, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` in a task of the session's that the caller's cancellation does not interrupt."""
        task = asyncio.ensure_future(awaitable)
        inflight = self._binding(session_id).inflight
        inflight.add(task)
        task.add_done_callback(inflight.discard)
        return await asyncio.shield(task)

    # ---- the end -------------------------------------------------------------------------
    async def release(self, session: Session, *, wait_s: float = 30.0) -> None:
        """Wait (up to ``wait_s``) for the session's calls in flight, then drop its caches on every replica it used."""
        sid = session.session_id
        self.detach(session)
        binding = self._bindings.pop(sid, None)
        if binding is None:
            return
        self._home(binding, -1)
        if binding.inflight:
            await asyncio.wait(set(binding.inflight), timeout=wait_s)
        calls = [self.draft_clients[ep].release(sid) for ep in binding.drafts_used]
        calls += [self.target_clients[ep].release(sid) for ep in binding.targets_used]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.info("release_incomplete", session_id=sid, errors=[type(e).__name__ for e in failed])

    async def close(self) -> None:
        batchers = [*self.batchers.values(), *self.propose_batchers.values()]
        await asyncio.gather(*(b.close() for b in batchers), return_exceptions=True)
        await WorkerClients(self.draft_clients, self.target_clients).close()


def _without_proposal(
    item: target_pb2.VerifyItem, session_id: str, endpoint: str, refusal: errors.SpecServeError
) -> target_pb2.VerifyItem:
    """The target refused the item's proposal (whole call or item alone): logged, and the item again with no
    proposal, for one more try at gamma 0 (still asking for what the round reports: logprobs, features)."""
    log.error("verify_refused_proposal_gamma_0", session_id=session_id, endpoint=endpoint, error=refusal.message)
    retry = target_pb2.VerifyItem()
    retry.CopyFrom(item)
    retry.ClearField("proposal")
    retry.proposal.SetInParent()
    retry.decode_steps = 1
    return retry


def _session_propose_request(
    session: Session, base, start: int, tokens: Sequence[int], gamma: int
) -> draft_pb2.ProposeRequest:
    """A Propose for ``session`` after ``base``: its sampling, proposer and stop settings."""
    return propose_request(
        base,
        start_position=start,
        token_ids=tokens,
        sampling=session.sampling,
        gamma=gamma,
        proposer=session.speculation.proposer,
        draft_top_k=session.speculation.draft_top_k,
        min_confidence=session.speculation.min_confidence,
        stop_token_ids=session.stop.stop_token_ids,
        ignore_eos=session.stop.ignore_eos,
        stop_tokens_from=session.prompt_len + session.stop.min_new_tokens if session.stop.min_new_tokens else 0,
        prompt_len=session.prompt_len,
        cache_scope=session.cache_scope,
    )
