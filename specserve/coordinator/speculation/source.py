"""A proposal source: one way a session's rounds get draft tokens (docs/design.md, "Proposal sources").

Every source is a :class:`Source` in one module of ``specserve/coordinator/speculation/sources/``, registered
in that package's ``SOURCES``; per session the
:class:`~specserve.coordinator.speculation.speculator.Speculator` holds those :meth:`Source.build` made for
it, in registration order. A source with a tracker of its own (``prior`` set) is asked first and drafts only
where its own acceptance pays; the others are the session's proposers, sharing its tracker, the first with
tokens drafting the round.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from specserve.coordinator.messages import Proposal, Verified, VerifyRequest
from specserve.coordinator.requests import GenerationRequest
from specserve.coordinator.session import Session
from specserve.coordinator.speculation.acceptance import AcceptanceTracker
from specserve.coordinator.speculation.policy import LoadSnapshot
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.runtime.config import CoordinatorSettings


class Fleet(Protocol):
    """What speculation asks of the worker fleet (``WorkerPool``)."""

    def load(self) -> LoadSnapshot: ...

    def bind_round(self, session: Session) -> None: ...

    async def propose(
        self, session: Session, gamma: int, *, features: Any = None, tree: TreeBudget = CHAIN
    ) -> Proposal: ...

    def propose_ahead(
        self, session: Session, hypothesis: Sequence[int], gamma: int
    ) -> asyncio.Task[Proposal | None] | None: ...


@dataclass(frozen=True)
class SourceSetup:
    """What a session's sources are built from."""

    session: Session
    request: GenerationRequest
    fleet: Fleet
    settings: CoordinatorSettings
    max_gamma: int  # the server's largest gamma (the workers' limits)
    #: The request's constraint as a grammar matcher, built on demand (None: no constraint).
    matcher: Callable[[], Any] | None = None
    #: The target's tokenizer, text to token ids.
    encode: Callable[[str], Sequence[int]] | None = None


class Source(abc.ABC):
    """One way to draft a session's rounds (see the module docstring); one instance per session."""

    #: The source's name in the stats, the metrics and the logs.
    name: ClassVar[str]
    #: Proposes without a draft call (no model cost: the policy's question).
    free: ClassVar[bool] = True
    #: Built only where ``CoordinatorSettings.opt_in_sources`` names it.
    opt_in: ClassVar[bool] = False
    #: The prior of a tracker of its own (None: the source shares the session's tracker).
    prior: ClassVar[float | None] = None
    #: Its own tracker opens at the best rung for its prior (a free source falls at once where wrong).
    warm_start: ClassVar[bool] = False
    #: Its draft call may branch into a tree from the draft's own ranking (``tree`` of :meth:`propose`).
    trees: ClassVar[bool] = False

    def __init__(self) -> None:
        self.tracker: AcceptanceTracker | None = None
        if self.prior is not None:
            self.tracker = AcceptanceTracker(prior_alpha=self.prior)
            self.tracker.warm_start = self.warm_start

    @classmethod
    @abc.abstractmethod
    def build(cls, setup: SourceSetup) -> Source | None:
        """This source for the session of ``setup`` (None: it does not apply to the session)."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether :meth:`propose` may offer tokens now (for a gamma of at least 1)."""

    @abc.abstractmethod
    async def propose(self, gamma: int, tree: TreeBudget = CHAIN) -> Proposal:
        """Up to ``gamma`` tokens to follow the committed ones (none: nothing to offer); a source with
        :attr:`trees` may branch as far as ``tree`` lets it (the others draft chains)."""

    def shadow(self, n: int) -> tuple[int, ...]:
        """What it would propose for ``n`` positions now, recording nothing (``()``: no guess)."""
        return ()

    def branch(self, n: int, min_path_probability: float) -> tuple[int, ...]:
        """A free guess of up to ``n`` tokens to hang on another source's tree, in a round whose alternatives
        need a path probability of ``min_path_probability`` (``()``: none; docs/design.md, "Free branches")."""
        return ()

    def observe(self, tokens: Sequence[int]) -> None:
        """Tokens just committed after those observed before."""
        return None

    def learn(self, *, proposed: int, accepted: int) -> None:
        """One outcome of its guesses (a round it drafted, or its shadow) into its own tracker."""
        assert self.tracker is not None
        self.tracker.observe(proposed=proposed, accepted=accepted)

    def ask(self, request: VerifyRequest) -> VerifyRequest:
        """The round's Verify item with what this source needs of the target added (every round)."""
        return request

    def verified(self, verified: Verified) -> None:
        """The round's verified item (every round that got a verdict)."""
        return None

    async def beside(self, proposal: Proposal, verifying: Awaitable[Verified]) -> Verified:
        """Await the verify of a round this source drafted, with its own work beside it."""
        return await verifying


class LocalSource(Source):
    """A source that drafts from the committed tokens alone, in the coordinator: no call, no batch to wait for.
    Its proposals are point masses (the target accepts a token with its own probability of it)."""

    @abc.abstractmethod
    def shadow(self, n: int) -> tuple[int, ...]: ...

    def draft(self, gamma: int) -> tuple[int, ...]:
        """The tokens :meth:`propose` offers (a source that counts what it drafted records it here)."""
        return self.shadow(gamma) if gamma > 0 else ()

    async def propose(self, gamma: int, tree: TreeBudget = CHAIN) -> Proposal:
        return Proposal(self.draft(gamma))
