"""A round's messages inside the coordinator: :class:`Proposal`, :class:`VerifyRequest`, :class:`Verified`.

A source drafts a :class:`Proposal`; the speculator wraps it in the session's :class:`VerifyRequest`; the fleet
sends that in a Verify call and hands back :class:`Verified` (the verdict or the error, and what the call cost).
They are the coordinator's own types: only the fleet's client module (``specserve/coordinator/fleet/clients.py``)
converts them to and from the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from specserve.api.errors import SpecServeError
from specserve.api.params import SessionBase, Verdict
from specserve.core.features import FeatureBlock


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one round, who drafted them and what drafting cost (empty: the round runs at gamma 0)."""

    token_ids: tuple[int, ...] = ()  # [gamma]
    #: [gamma] or empty (point masses): the distribution each token was drawn from, as the draft sent it. Opaque
    #: here; the fleet's client module passes them from the draft's reply to the Verify item undecoded.
    distributions: tuple[Any, ...] = ()
    #: A draft tree (docs/design.md, "Draft trees: exact acceptance"): token i's parent, -1 for the committed
    #: prefix's pending position, else an earlier token; empty: a chain. A ``None`` distribution (beside others)
    #: is a point mass on its token, which the fleet's client module writes out for the target.
    parents: tuple[int, ...] = ()
    source: str = ""  # the drafting source's name ("": nobody)
    wall_ns: int = 0  # the draft call(s) as the coordinator saw them, batching wait included (0: no call)
    draft_ns: int | None = None  # the draft's own account of its work (None: no draft answered)
    queue_ns: int = 0  # waiting in the coordinator for the ProposeBatch call to leave
    prefill_tokens: int = 0  # committed tokens the draft fed to catch up before drafting
    expansion_passes: int = 0  # draft passes that expanded a tree below its alternatives (beyond the chain's)
    #: The feature head lacks the target's features from this position on (it drafted nothing); None: none lacking.
    features_needed_from: int | None = None

    @property
    def depth(self) -> int:
        """Positions past the committed prefix it reaches: a chain's gamma, a tree's levels."""
        if not self.parents:
            return len(self.token_ids)
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths)

    @property
    def network_ns(self) -> int:
        """The call's time beyond the draft's own account and the wait for a batch (0 without an answer)."""
        return 0 if self.draft_ns is None else max(0, self.wall_ns - self.queue_ns - self.draft_ns)

    @property
    def from_call(self) -> bool:
        """Drafted by a draft call made for this round (not in the coordinator, nor ahead during the last one)."""
        return self.draft_ns is not None and self.wall_ns > 0

    def with_branch(self, lookup: Sequence[int], room: int | None = None) -> Proposal:
        """This proposal with the part of ``lookup`` it lacks as a branch (docs/design.md, "Free branches"):
        ``lookup`` walks down from the root through the node that carries each of its tokens (a chain: its
        tokens in order), and the rest of it hangs below the last node reached (the root when none), a later
        sibling of that node's children; at most ``room`` nodes of it (None: all). Itself when the lookup adds
        nothing. The branch's distributions are point masses (``None``) where the proposal carries any; a
        branch that only continues a chain leaves a chain (its parents spelt out)."""
        tokens = self.token_ids
        parents = self.parents or tuple(range(-1, len(tokens) - 1))
        child_of = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents, strict=True))}  # siblings differ
        node = -1
        shared = 0
        for token in lookup:
            child = child_of.get((node, token))
            if child is None:
                break
            node, shared = child, shared + 1
        branch = tuple(int(t) for t in lookup[shared:])[: None if room is None else max(0, room)]
        if not branch:
            return self
        n = len(tokens)
        return replace(
            self,
            token_ids=tokens + branch,
            distributions=(*self.distributions, *(None,) * len(branch)) if self.distributions else (),
            parents=(*parents, node, *range(n, n + len(branch) - 1)),
        )

    def first(self, n: int) -> Proposal:
        """The first ``n`` tokens, with their distributions (and nothing of what drafting cost)."""
        return Proposal(self.token_ids[:n], self.distributions[:n], source=self.source)


#: A round without a proposal.
NO_PROPOSAL = Proposal()


@dataclass(frozen=True)
class FeatureAsk:
    """The target's features a Verify item asks for (docs/design.md, "The feature head")."""

    start: int  # from this position
    uncached: bool  # or from where the target's prefix-cache hit ends, when later
    max_bytes: int  # at most this many bytes (whole rows, at least one)


@dataclass(frozen=True)
class VerifyRequest:
    """One session's item of a Verify call: its proposal after its committed prefix ``base``."""

    base: SessionBase
    proposal: Proposal = NO_PROPOSAL
    decode_steps: int = 1  # target steps: the proposal's verify pass, then gamma-0 steps (VerifyItem.decode_steps)
    top_logprobs: int | None = None  # report the committed tokens' logprobs with this many alternatives
    features: FeatureAsk | None = None
    cache_scope: bytes = b""

    def without_proposal(self) -> VerifyRequest:
        """The same item at gamma 0, one target step (still asking for what the round reports)."""
        return replace(self, proposal=NO_PROPOSAL, decode_steps=1)


@dataclass(frozen=True)
class CallCost:
    """What one Verify call cost, as each of its items' results reports it."""

    queue_ns: int = 0  # the item waited this long in the coordinator for the call to leave
    call_ns: int = 0  # the call's wall-clock time as the coordinator saw it
    verify_ns: int = 0  # the target's own account of the call
    forward_ns: int = 0  # the target's forward passes in it
    batch_size: int = 1
    positions_processed: int = 0
    draft_tokens: int = 0  # draft distributions the whole call carried
    reports_call: bool = False  # the one result of its call that reports the call's cost
    decode_steps: int = 1  # most target steps an item of the call asked for


@dataclass(frozen=True)
class Verified:
    """A :class:`VerifyRequest`'s outcome: a verdict (maybe replayed) or the error that kept it uncommitted."""

    request: VerifyRequest  # as last sent (without its proposal after a refused one)
    verdict: Verdict | None = None
    error: SpecServeError | None = None
    replayed: bool = False
    features: FeatureBlock | None = None  # what ``request.features`` asked for, when the target sent it
    cached_tokens: int = 0  # committed tokens the target took from its prefix cache in this call
    cost: CallCost = CallCost()

    @property
    def session_id(self) -> str:
        return self.request.base.session_id
