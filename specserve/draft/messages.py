"""The draft's domain requests and results: what the engine takes and returns.

They hold no wire: :mod:`specserve.draft.servicer` converts a ``ProposeRequest``
to a :class:`ProposeCall` (``call_from_pb``) and a :class:`ProposeResult` back
(``proposal_pb``), a ``ProposeBatchRequest`` to a :class:`ProposeBatchCall`
(``batch_call_from_pb``) and a :class:`ProposeBatchResult` back
(``batch_response_pb``). A call is checked as it is converted: everything that
can be checked without the session's state, raising
:class:`~specserve.api.errors.InvalidArgument` saying what to fix, before any
work (a history longer than ``max_tokens``, the draft's context, is refused
before its tokens are even looked at); the engine then checks the state (does
it know the committed tokens before ``start_position``?). A batch is checked the
same way per item: a bad item becomes that item's error, the call goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.api.errors import SpecServeError
from specserve.api.params import SamplingParams, SessionBase
from specserve.core.features import FeatureBlock
from specserve.core.ranked_tree import CHAIN, TreeBudget
from specserve.draft.proposers import Drafted


@dataclass(frozen=True)
class ProposeCall:
    """A checked ``ProposeRequest``."""

    base: SessionBase
    start_position: int
    token_ids: tuple[int, ...]  # committed tokens [start_position, base.committed_len)
    sampling: SamplingParams
    gamma: int
    proposer: int  # ProposerKind, UNSPECIFIED resolved to MODEL
    draft_top_k: int
    seed: int
    stop_token_ids: frozenset[int] = frozenset()  # drafting ends after one of these
    ignore_eos: bool = False  # ... and after the model's end-of-sequence tokens unless this is set
    min_confidence: float = 0.0  # the proposal ends after a token drafted with probability below this
    features: FeatureBlock | None = None  # the target's features the draft has not seen (feature proposer)
    features_reset: bool = False  # ... which start a fresh context
    stop_tokens_from: int = 0  # min_new_tokens: stop tokens masked for tokens drafted before this position
    prompt_len: int = 0  # the session's prompt length (a constraint applies after it); 0: not sent
    #: The session's prefix-cache scope: its cache attaches and shares blocks of it only.
    cache_scope: bytes = b""
    tree: TreeBudget = CHAIN  # how far the proposal may branch into the draft's alternatives

    @property
    def session_id(self) -> str:
        return self.base.session_id


@dataclass(frozen=True, eq=False)
class ProposeResult:
    """A proposal with its cost."""

    drafted: Drafted
    draft_ns: int


@dataclass(frozen=True)
class ProposeBatchCall:
    """A ``ProposeBatchRequest``: each item checked on its own (a bad item is that item's error)."""

    items: tuple[ProposeCall | SpecServeError, ...]

    @property
    def calls(self) -> list[ProposeCall]:
        """The well-formed items, in order."""
        return [i for i in self.items if isinstance(i, ProposeCall)]


@dataclass(frozen=True, eq=False)
class ProposeBatchResult:
    """One outcome per item of a :class:`ProposeBatchCall`, in order, and the call's time."""

    outcomes: tuple[ProposeResult | SpecServeError, ...]
    draft_ns: int

    @classmethod
    def merge(
        cls, call: ProposeBatchCall, drafted: Sequence[ProposeResult | SpecServeError], draft_ns: int
    ) -> ProposeBatchResult:
        """The outcomes of ``call``'s items: its refused items' errors, the rest from ``drafted`` (for ``call.calls``)."""
        rest = iter(drafted)
        outcomes = tuple(item if isinstance(item, SpecServeError) else next(rest) for item in call.items)
        return cls(outcomes=outcomes, draft_ns=draft_ns)
