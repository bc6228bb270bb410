"""Every proposal source, registered once: :data:`SOURCES`, in the order a session asks them."""

from specserve.coordinator.speculation.source import Source
from specserve.coordinator.speculation.sources.draft_model import DraftModel
from specserve.coordinator.speculation.sources.feature_head import FeatureHead
from specserve.coordinator.speculation.sources.forced_text import ForcedText
from specserve.coordinator.speculation.sources.ngram import HybridLookup, Ngram
from specserve.coordinator.speculation.sources.prediction import Prediction
from specserve.coordinator.speculation.sources.repeat_last import RepeatLast

#: Sources with a tracker of their own are asked first, in this order; then the session's proposers, in this order.
SOURCES: tuple[type[Source], ...] = (
    ForcedText,
    HybridLookup,
    RepeatLast,
    Prediction,
    Ngram,
    FeatureHead,
    DraftModel,
)
