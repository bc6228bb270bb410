"""The features a target ships to the feature head, made from its own passes (docs/design.md, "The feature head").

A :class:`FeatureMaker` makes the feature the draft tier's head reads: :meth:`FeatureMaker.tap` records what
it needs while a pass of the target runs, and :meth:`FeatureTap.rows` turns a row of that pass into features
``[n, hidden]`` float32 (the caller ships them float16):

* ``last_hidden_rms`` (EAGLE-1's): the last decoder layer's output over its RMS (:func:`features_of`);
* ``fused_layers`` (EAGLE-3's): the outputs of the head's ``fused_layers``, each over its RMS, concatenated and
  projected by the head's ``fuse`` matrix (:meth:`~specserve.engine.feature_head.FeatureHead.fused`). The
  target projects, so the wire carries ``hidden`` values per position, not ``layers x hidden``.

:attr:`FeatureMaker.name` names the feature (:func:`~specserve.engine.feature_head.feature_name`); the target
reports it (GetTargetInfo), a draft the one its head reads (GetDraftInfo), and a coordinator does not start
where they differ. The verifier's batched pass and a session cache's own passes
(:mod:`specserve.engine.kvcache`) both make their features here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specserve.api.errors import FailedPrecondition
from specserve.engine.feature_head import (
    FEATURE_FUSED_LAYERS,
    FEATURE_LAST_HIDDEN_RMS,
    WEIGHTS,
    FeatureHeadConfig,
    FinalNormInput,
    LayerOutputs,
    feature_name,
    fuse_states,
    target_features,
)


def rms_eps(model: Any) -> float:
    """The epsilon of ``model``'s norms (Llama-like or GPT-2)."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_epsilon", None) or 1e-6


def features_of(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``model``'s features (:func:`~specserve.engine.feature_head.target_features`) of last-layer states
    ``[..., hidden]`` captured before its final norm."""
    return target_features(hidden, rms_eps(model))


class FeatureTap:
    """What one pass recorded for the features (see :meth:`FeatureMaker.tap`)."""

    def __init__(self, maker: FeatureMaker) -> None:
        self.maker = maker
        self._taps = (
            LayerOutputs(maker.model, list(maker.layers)) if maker.layers else FinalNormInput(maker.model)
        )

    def __enter__(self) -> FeatureTap:
        self._taps.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._taps.__exit__(*exc)

    def rows(self, b: int, n: int) -> torch.Tensor:
        """The features of the first ``n`` positions of the pass's row ``b``: ``[n, hidden]`` float32."""
        if isinstance(self._taps, FinalNormInput):
            if self._taps.hidden is None:
                raise RuntimeError("no forward pass recorded")
            return features_of(self.maker.model, self._taps.hidden[b, :n])
        assert self.maker.fuse is not None
        outputs = self._taps.outputs  # per layer [batch, T, hidden]
        if any(o is None for o in outputs):
            raise RuntimeError("no forward pass recorded")
        states = torch.stack([o[b, :n] for o in outputs if o is not None], dim=-2)  # [n, layers, hidden]
        return fuse_states(states, self.maker.fuse, self.maker.eps)


class FeatureMaker:
    """Makes one kind of feature from a target ``model``'s passes: the last layer's (no ``head``), or the one
    the head of config ``head`` reads, with its ``fuse`` matrix ``[hidden, layers * hidden]`` where fused.

    Raises :class:`FailedPrecondition` where the head does not fit the model (width, layers)."""

    def __init__(
        self, model: Any, head: FeatureHeadConfig | None = None, fuse: torch.Tensor | None = None
    ) -> None:
        config = model.config.get_text_config(decoder=True)
        self.model = model
        self.hidden_size = int(config.hidden_size)
        self.eps = rms_eps(model)
        #: The target layers of a fused feature (empty: the last layer's feature).
        self.layers: tuple[int, ...] = ()
        #: The fused feature's projection ``[hidden, layers * hidden]`` float32, on the model's device.
        self.fuse: torch.Tensor | None = None
        kind = FEATURE_LAST_HIDDEN_RMS if head is None else head.feature
        if head is not None and head.hidden_size != self.hidden_size:
            raise FailedPrecondition(
                f"the feature head reads features of {head.hidden_size} values; this target's are {self.hidden_size}"
            )
        if kind == FEATURE_FUSED_LAYERS:
            assert head is not None and head.fused_layers
            if not hasattr(model.get_decoder(), "layers"):
                raise FailedPrecondition(
                    "a fused feature taps a Llama-like target's decoder layers; this one has none"
                )
            depth = int(config.num_hidden_layers)
            if not all(0 <= i < depth for i in head.fused_layers):
                raise FailedPrecondition(
                    f"the feature head fuses layers {head.fused_layers}; this target has layers 0..{depth - 1}"
                )
            shape = (self.hidden_size, len(head.fused_layers) * self.hidden_size)
            if fuse is None or tuple(fuse.shape) != shape:
                raise FailedPrecondition(f"a fused feature needs the head's fuse matrix {shape}")
            self.layers = tuple(head.fused_layers)
            device = next(model.parameters()).device
            self.fuse = fuse.detach().to(device=device, dtype=torch.float32)
        #: The feature's name (:func:`~specserve.engine.feature_head.feature_name`).
        self.name = feature_name(kind, self.hidden_size, list(self.layers), fuse)

    @classmethod
    def for_head(cls, model: Any, directory: str | Path) -> FeatureMaker:
        """The maker of the feature the head in ``directory`` reads; only its ``config.json`` and, for a fused
        head, its ``fuse.weight`` are read."""
        from safetensors import safe_open

        path = Path(directory)
        if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
            raise FailedPrecondition(f"{path} is not a feature head directory (config.json and {WEIGHTS})")
        head = FeatureHeadConfig.from_json_file(str(path / "config.json"))
        fuse = None
        if head.feature == FEATURE_FUSED_LAYERS:
            with safe_open(str(path / WEIGHTS), framework="pt") as f:
                if "fuse.weight" not in f.keys():
                    raise FailedPrecondition(f"{path}: a fused head without its fuse.weight")
                fuse = f.get_tensor("fuse.weight")
        return cls(model, head, fuse)

    def tap(self) -> FeatureTap:
        """``with maker.tap() as tap: model(...)``, then ``tap.rows(b, n)``: the features of that pass."""
        return FeatureTap(self)
