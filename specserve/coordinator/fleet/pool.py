"""The coordinator's workers: every replica of both tiers, the sessions bound to them, and failover.

One :class:`WorkerPool` per coordinator, built from the probed limits
(:mod:`specserve.coordinator.fleet.limits`). Speculation asks it for a draft call (:meth:`WorkerPool.propose`)
and the round for a verdict (:meth:`WorkerPool.verify`); the pool binds a round to its replicas (and to their
batchers, whose batches wait only for sessions bound to them) and fails over: a failed draft call leaves the
round without a proposal, a replica fault sends the same Verify item, idempotent per ``(session, version)``,
to the next replica of the session's order. The rest is in modules of its own:
:mod:`~specserve.coordinator.fleet.routing`, :mod:`~specserve.coordinator.fleet.breakers`,
:mod:`~specserve.coordinator.fleet.batcher`, :mod:`~specserve.coordinator.fleet.costs` and the wire,
:mod:`~specserve.coordinator.fleet.clients`. What each fault does: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import structlog

from specserve.api import errors
from specserve.api.params import SessionBase
from specserve.coordinator.fleet.batcher import ProposeBatcher, VerifyBatcher
from specserve.coordinator.fleet.clients import DraftCall, WorkerClients
from specserve.coordinator.fleet.costs import CallCosts
from specserve.coordinator.fleet.routing import ReplicaSet, Route, Routes
from specserve.coordinator.messages import NO_PROPOSAL, Proposal, Verified, VerifyRequest
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.cost_model import CostModel
from specserve.coordinator.speculation.policy import LoadSnapshot
from specserve.core.features import FeatureBlock
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.runtime.config import CoordinatorSettings

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: How often a round waiting for a breaker (every target backing off) looks again, in seconds.
ALL_DOWN_POLL_S = 0.25


class FeatureStream(Protocol):
    """What a draft call carries for the feature head: the feature source's relay of the target's features."""

    def outgoing(self, endpoint: str, committed_len: int, max_bytes: int) -> tuple[FeatureBlock, bool]: ...

    def sent(self, endpoint: str, block: FeatureBlock) -> None: ...

    def needed(self, endpoint: str, position: int, committed_len: int) -> bool: ...

    def refused(self) -> None: ...


def _detail(exc: BaseException) -> str:
    """What the log says of a failed worker call: the endpoint and gRPC's own details where known."""
    return getattr(exc, "detail", None) or str(exc)


@dataclass
class _Binding:
    """What the pool knows of one session between :meth:`WorkerPool.attach` and :meth:`WorkerPool.release`."""

    attached: bool = False
    drafts_used: set[str] = field(default_factory=set)
    targets_used: set[str] = field(default_factory=set)
    inflight: set[asyncio.Task] = field(default_factory=set)


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
        self.costs = CallCosts(cost_model)
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
        self.routes = Routes(
            self.targets,
            self.drafts,
            prefix_tokens=settings.route_prefix_tokens,
            factor=settings.route_load_factor,
            slack=settings.route_load_slack,
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
            self.routes.leave(session.session_id)
        self._bind(session.session_id, None)
        self._bind_draft(session.session_id, None)

    @property
    def active_sessions(self) -> int:
        """Sessions between :meth:`attach` and :meth:`detach`."""
        return self._active

    def load(self) -> LoadSnapshot:
        """How busy the target tier is now (for the policy)."""
        queued = sum(b.queued for b in self.batchers.values())
        occupancy = min(1.0, self.costs.recent_batch / self.settings.max_batch_size)
        return LoadSnapshot(
            active_sessions=max(1, self.active_sessions), batch_occupancy=occupancy, verify_queue_depth=queued
        )

    # ---- routing ---------------------------------------------------------------------------
    def _route(self, session: Session) -> Route:
        self._binding(session.session_id)
        return self.routes.route(session.session_id, session.token_ids[: session.prompt_len], session.cache_scope)

    def target_for(self, session: Session) -> str | None:
        """The first target replica of the session's order that is not backing off."""
        return self.targets.first_up(self._route(session).targets)

    def draft_for(self, session: Session) -> str | None:
        """The first draft replica of the session's order that is not backing off."""
        return self.drafts.first_up(self._route(session).drafts)

    def draft_of(self, session_id: str) -> str | None:
        """The first draft replica of a routed session's order that is not backing off (None: not routed)."""
        route = self.routes.get(session_id)
        return None if route is None else self.drafts.first_up(route.drafts)

    def bound_targets(self) -> dict[str, str]:
        """Session id -> the target its next Verify item goes to, for the sessions in a round (a copy)."""
        return dict(self._assigned)

    def drafting_sessions(self) -> dict[str, int]:
        """Per draft replica, the sessions drafting through its batcher and not inside a Verify (a copy): the
        ones its next ProposeBatch waits for."""
        return dict(self._per_draft)

    # ---- Propose -------------------------------------------------------------------------
    def bind_round(self, session: Session) -> None:
        """A round starts: the session is bound to its target replica, whose next batch waits for its item, and
        to no draft batcher until a draft call (:meth:`propose`) binds it to one."""
        self._bind(session.session_id, self.target_for(session))
        self._bind_draft(session.session_id, None)

    async def propose(
        self, session: Session, gamma: int, *, features: FeatureStream | None = None, tree: TreeBudget = CHAIN
    ) -> Proposal:
        """Up to ``gamma`` draft tokens from the session's draft replica after its committed tokens (none: gamma
        0, every draft replica backing off, or any failure). ``features``: a feature session's relay, whose rows
        the call carries; ``tree``: how far the proposal may branch into the draft's alternatives."""
        sid = session.session_id
        self._bind(sid, self.target_for(session))
        endpoint = self.draft_for(session) if gamma > 0 else None
        self._bind_draft(sid, endpoint if endpoint in self.propose_batchers else None)
        if endpoint is None:  # gamma 0, or every draft replica is backing off
            return NO_PROPOSAL
        self._binding(sid).drafts_used.add(endpoint)
        start_ns = time.perf_counter_ns()
        try:
            proposal = await self._propose_on(endpoint, session, gamma, features, tree)
        except Exception as exc:  # any failure: this round runs at gamma = 0
            wall_ns = time.perf_counter_ns() - start_ns
            session.draft_lost()
            if features is not None:
                features.refused()
            backoff = self.drafts.fault(endpoint, exc)
            (log.warning if backoff is not None else log.info)(
                "draft_fault_gamma_0" if backoff is not None else "draft_refused_gamma_0",
                session_id=sid,
                endpoint=endpoint,
                error=type(exc).__name__,
                detail=_detail(exc),
                backoff_s=backoff,
            )
            return Proposal(wall_ns=wall_ns)
        proposal = dataclasses.replace(proposal, wall_ns=time.perf_counter_ns() - start_ns)
        session.draft_caught_up(endpoint)
        self.drafts.mark_ok(endpoint)
        self.costs.propose(proposal)
        if proposal.depth > gamma or len(proposal.token_ids) > max(gamma, tree.max_nodes):
            log.error("draft_overproposed", session_id=sid, asked=gamma, got=len(proposal.token_ids))
            return Proposal(wall_ns=proposal.wall_ns, draft_ns=proposal.draft_ns, queue_ns=proposal.queue_ns)
        return proposal

    def propose_ahead(
        self, session: Session, hypothesis: Sequence[int], gamma: int
    ) -> asyncio.Task[Proposal | None] | None:
        """Start drafting after ``committed + hypothesis``, unbatched, on the draft replica the session's last
        Propose went to (None: not possible now). The task's result is that proposal (None on any failure,
        which is never a fault). It moves no bookkeeping: the draft records the hypothetical tokens as the
        session's prefix, and the next real Propose resends every token after what it really saw
        (``Session.unseen_by_draft``), which the draft reconciles."""
        endpoint = session.draft_endpoint
        if endpoint is None or endpoint not in self.draft_clients or self.draft_for(session) != endpoint:
            return None
        start, tokens = session.unseen_by_draft(endpoint)
        tokens = (*tokens, *hypothesis)
        base = dataclasses.replace(session.base, committed_len=start + len(tokens))
        call = _draft_call(session, base, start, tokens, gamma)

        async def draft() -> Proposal | None:
            try:
                return await self.draft_clients[endpoint].propose_one(call)
            except Exception as exc:  # a missed chance, not a fault
                log.debug("propose_ahead_failed", session_id=session.session_id, error=type(exc).__name__)
                return None

        return asyncio.create_task(draft())

    async def _propose_on(
        self, endpoint: str, session: Session, gamma: int, features: FeatureStream | None, tree: TreeBudget
    ) -> Proposal:
        sid = session.session_id
        start, tokens = session.unseen_by_draft(endpoint)
        try:
            proposal = await self._shielded(
                sid, self._send_propose(endpoint, session, start, tokens, gamma, features, tree)
            )
        except errors.FailedPrecondition:
            # The draft lacks tokens before start_position: resend everything (and the head's context).
            if features is not None:
                features.refused()
            proposal = await self._shielded(
                sid, self._send_propose(endpoint, session, 0, session.token_ids, gamma, features, tree)
            )
        if features is not None and proposal.features_needed_from is not None:
            # The head lacks features from there: sent again at once when the relay holds them, else asked of
            # the target (the round runs at gamma 0 meanwhile).
            session.draft_caught_up(endpoint)
            if features.needed(endpoint, proposal.features_needed_from, session.committed_len):
                start, tokens = session.unseen_by_draft(endpoint)
                proposal = await self._shielded(
                    sid, self._send_propose(endpoint, session, start, tokens, gamma, features, tree)
                )
                if proposal.features_needed_from is not None:
                    features.needed(endpoint, proposal.features_needed_from, session.committed_len)
        return proposal

    async def _send_propose(
        self,
        endpoint: str,
        session: Session,
        start: int,
        tokens: tuple[int, ...],
        gamma: int,
        features: FeatureStream | None,
        tree: TreeBudget,
    ) -> Proposal:
        """The one way a Propose leaves for the draft replica at ``endpoint`` (batched or alone), with the
        target's features the replica lacks for a feature session and the round's tree budget."""
        call = dataclasses.replace(_draft_call(session, session.base, start, tokens, gamma), tree=tree)
        if features is not None:
            block, reset = features.outgoing(endpoint, session.committed_len, self.settings.feature_bytes_per_call)
            call = dataclasses.replace(call, features=block, features_reset=reset)
        batcher = self.propose_batchers.get(endpoint)
        if batcher is not None:
            batched = await batcher.submit(call, constraint=session.sampling.constraint)
            if batched.error is not None:
                raise batched.error
            assert batched.proposal is not None
            proposal = batched.proposal
        else:
            proposal = await self.draft_clients[endpoint].propose_one(call)
        if features is not None:
            features.sent(endpoint, block)
        return proposal

    # ---- Verify --------------------------------------------------------------------------
    async def verify(self, session: Session, request: VerifyRequest, *, drafted: bool = False) -> Verified:
        """Verify ``request`` on the session's target replica, failing over (docs/reliability.md, "Mechanisms").

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
                verified = await self._shielded(sid, self._submit_verify(session, endpoint, request))
            except errors.InvalidArgument as exc:
                if not request.proposal.token_ids:
                    raise
                last_exc = exc
                request = _without_proposal(request, sid, endpoint, exc)
                continue
            except errors.ResourceExhausted as exc:
                last_exc = exc
                log.warning(
                    "verify_retry", session_id=sid, endpoint=endpoint, detail=_detail(exc), version=session.version
                )
                await asyncio.sleep(0.05 * attempt)
                continue
            except Exception as exc:
                if self.targets.fault(endpoint, exc) is None:
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
            self.costs.verify(verified, drafted=drafted and bool(request.proposal.token_ids))
            refused = verified.error
            if isinstance(refused, errors.InvalidArgument) and request.proposal.token_ids:
                # The proposal may be the draft's bug: the session gets one more try without it.
                last_exc = refused
                request = _without_proposal(request, sid, endpoint, refused)
                continue
            return verified
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

    async def _submit_verify(self, session: Session, endpoint: str, request: VerifyRequest) -> Verified:
        """One Verify attempt through the replica's batcher.

        The session counts as verifying while it waits; it stops as soon as its result is in, before its
        round resumes: the sessions of one Verify batch all resume together, and the first of them to
        propose then waits for the others (``_expected_drafting``).
        """
        self._verifying_now(session.session_id, True)
        try:
            return await self.batchers[endpoint].submit(request, constraint=session.sampling.constraint)
        finally:
            self._verifying_now(session.session_id, False)

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
        """Await ``awaitable`` in a task of the session's that the caller's cancellation does not interrupt, so a
        release (which waits for these tasks) never overtakes the request that would re-create a cache."""
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
        self.routes.drop(sid)
        binding = self._bindings.pop(sid, None)
        if binding is None:
            return
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
    request: VerifyRequest, session_id: str, endpoint: str, refusal: errors.SpecServeError
) -> VerifyRequest:
    """The target refused the item's proposal (whole call or item alone): logged, and the item again with no
    proposal, for one more try at gamma 0 (still asking for what the round reports: logprobs, features)."""
    log.error("verify_refused_proposal_gamma_0", session_id=session_id, endpoint=endpoint, error=refusal.message)
    return request.without_proposal()


def _draft_call(session: Session, base: SessionBase, start: int, tokens: Sequence[int], gamma: int) -> DraftCall:
    """A Propose for ``session`` after ``base``: its sampling, proposer and stop settings."""
    return DraftCall(
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
