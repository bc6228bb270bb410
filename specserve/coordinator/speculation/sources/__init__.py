"""Every proposal source, registered once: :data:`SOURCES`, in the order a session asks them."""

from collections.abc import Sequence

from specserve.coordinator.speculation.source import Source
from specserve.coordinator.speculation.sources.draft_model import DraftModel
from specserve.coordinator.speculation.sources.feature_head import FeatureHead
from specserve.coordinator.speculation.sources.forced_text import ForcedText
from specserve.coordinator.speculation.sources.ngram import HybridLookup, Ngram
from specserve.coordinator.speculation.sources.prediction import Prediction
from specserve.coordinator.speculation.sources.repeat_last import RepeatLast
from specserve.coordinator.speculation.sources.tree import ModelLookupTree

#: Sources with a tracker of their own are asked first, in this order; then the session's proposers, in this order.
SOURCES: tuple[type[Source], ...] = (
    ForcedText,
    HybridLookup,
    RepeatLast,
    Prediction,
    Ngram,
    FeatureHead,
    ModelLookupTree,
    DraftModel,
)


def check_opt_in(names: Sequence[str]) -> None:
    """``CoordinatorSettings.opt_in_sources`` names only opt-in sources (ValueError: which are not)."""
    known = sorted(c.name for c in SOURCES if c.opt_in)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"opt_in_sources names {unknown}, which are not opt-in proposal sources; known: {known}")
