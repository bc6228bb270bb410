"""Loading a local Hugging Face causal LM for a worker, and checking that a draft fits a target.

``load_model(path, device=, dtype=)`` loads any local model directory with
``AutoModelForCausalLM`` / ``AutoTokenizer`` (``local_files_only=True``: nothing is
ever downloaded) and returns a :class:`LoadedModel` that carries the facts a
service reports about itself (:class:`ModelInfo`): vocabulary size, a
fingerprint of the token table, EOS, device, dtype, parameter count.

* ``device="auto"``: CUDA when present, else CPU.
* ``dtype="auto"``: bfloat16 on CUDA, float32 on CPU. Greedy output is
  token-identical to target-only decoding only in float32 (see docs/design.md,
  "Numerics"); in bfloat16 the batched verify pass and single-step decoding
  round differently.

A draft and a target must share one vocabulary: :func:`check_same_vocabulary`
raises :class:`~specserve.api.errors.VocabularyMismatch` when the output sizes or the
token-table fingerprints differ.

A model is named by a registered name, a local directory or a hub id
(:func:`resolve_model_path`, :mod:`specserve.engine.model_registry`); with none, a
worker uses the default pair: the target SmolLM2-135M-Instruct (fetched once
from the package index) and the draft distilled from it (``specserve/models/``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
import torch

from specserve.api.errors import FailedPrecondition, InvalidArgument, VocabularyMismatch
from specserve.engine import attention, cpu_kernels, kernel_choice
from specserve.engine.cpu_kernels import Kernels
from specserve.v1 import common_pb2

log = structlog.get_logger(__name__)

Role = Literal["target", "draft"]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}



@dataclass(frozen=True)
class ModelInfo:
    """What a worker says about its model (``common.proto`` ``ModelInfo``)."""

    name: str
    vocab_size: int
    vocab_fingerprint: str
    device: str
    dtype: str
    eos_token_id: int | None
    parameter_count: int
    max_positions: int | None = None  # the context: most tokens a session may hold (None: unknown)

    @classmethod
    def from_pb(cls, pb: common_pb2.ModelInfo) -> ModelInfo:
        return cls(
            name=pb.model_name,
            vocab_size=pb.vocab_size,
            vocab_fingerprint=pb.vocab_fingerprint,
            device=pb.device,
            dtype=pb.dtype,
            eos_token_id=pb.eos_token_id if pb.HasField("eos_token_id") else None,
            parameter_count=pb.parameter_count,
            max_positions=pb.max_positions if pb.HasField("max_positions") and pb.max_positions else None,
        )

    def to_pb(self) -> common_pb2.ModelInfo:
        pb = common_pb2.ModelInfo(
            model_name=self.name,
            vocab_size=self.vocab_size,
            vocab_fingerprint=self.vocab_fingerprint,
            device=self.device,
            dtype=self.dtype,
            parameter_count=self.parameter_count,
        )
        if self.eos_token_id is not None:
            pb.eos_token_id = self.eos_token_id
        if self.max_positions is not None:
            pb.max_positions = self.max_positions
        return pb


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, no grad needed) and its facts."""

    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # rows of the output layer = logits' last dimension
    vocab_fingerprint: str  # hex sha256 of the token table (id -> token)
    eos_token_id: int | None
    parameter_count: int
    name: str

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            vocab_size=self.vocab_size,
            vocab_fingerprint=self.vocab_fingerprint,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            eos_token_id=self.eos_token_id,
            parameter_count=self.parameter_count,
            max_positions=self.max_positions,
        )

    @property
    def max_positions(self) -> int | None:
        """The context: ``max_position_embeddings`` of the model's text config (None when it has none)."""
        return max_positions(self.model.config)

    def to_pb(self) -> common_pb2.ModelInfo:
        return self.info.to_pb()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every end-of-sequence id: the tokenizer's and the generation config's (one id or a list)."""
        ids = {int(self.eos_token_id)} if self.eos_token_id is not None else set()
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif isinstance(configured, (list, tuple)):
            ids.update(int(t) for t in configured)
        return frozenset(ids)

    @torch.inference_mode()
    def warmup(self, n_tokens: int = 8) -> None:
        """One forward pass with a KV cache so the first request does not pay the start-up cost."""
        from transformers import DynamicCache

        ids = torch.zeros((1, n_tokens), dtype=torch.long, device=self.device)  # [1, n_tokens]
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, cache=cache, use_cache=True)
        self.model(input_ids=ids[:, :1], cache=cache, use_cache=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def max_positions(config: Any) -> int | None:
    """``max_position_embeddings`` of a transformers config's text part; None when absent or not positive."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"``: the first CUDA device when present, else CPU; otherwise ``torch.device(device)``."""
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InvalidArgument(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise FailedPrecondition(
            f"device {device!r} asked for, but CUDA is not available; use 'auto' or 'cpu'"
        )
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 on CPU; otherwise the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise InvalidArgument(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_model_path(spec: str | Path | None, role: Role) -> str:
    """What to load for ``role``: ``spec`` (a registered name, a directory or a hub id), else the default.

    The defaults are the registered default pair (``smollm2-135m-instruct`` and
    ``specserve-smollm2-draft``); a registered model missing from the cache is
    fetched first. Raises :class:`FailedPrecondition` saying what is accepted.
    """
    from specserve.engine import model_registry

    if spec is None or str(spec) == "":
        spec = model_registry.DEFAULT_TARGET if role == "target" else model_registry.DEFAULT_DRAFT
    return model_registry.resolve_model(spec)


def vocab_fingerprint(tokenizer: Any) -> str:
    """Hex SHA-256 of the token table: the JSON list of ``[id, token]`` pairs in id order.

    Two tokenizers with the same fingerprint map every id to the same token string.
    """
    table = sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items())
    blob = json.dumps(table, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def check_same_vocabulary(draft: ModelInfo | LoadedModel, target: ModelInfo | LoadedModel) -> None:
    """Raise :class:`VocabularyMismatch` unless the draft and the target share one vocabulary."""
    d = draft.info if isinstance(draft, LoadedModel) else draft
    t = target.info if isinstance(target, LoadedModel) else target
    if d.vocab_size != t.vocab_size:
        raise VocabularyMismatch(
            f"the draft {d.name!r} has a vocabulary of {d.vocab_size} tokens but the target {t.name!r} has "
            f"{t.vocab_size}; pair the target with a draft trained on the same tokenizer"
        )
    if d.vocab_fingerprint != t.vocab_fingerprint:
        raise VocabularyMismatch(
            f"the draft {d.name!r} and the target {t.name!r} both have {d.vocab_size} tokens but different "
            f"token tables (fingerprint {d.vocab_fingerprint[:12]}... vs {t.vocab_fingerprint[:12]}...); "
            "pair the target with a draft trained on the same tokenizer"
        )


def _memory_bytes(model: Any) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.packed for m in model.modules() if isinstance(m, cpu_kernels.PackedLinear)]
    return sum(t.numel() * t.element_size() for t in tensors)


def vocab_size_of(model: Any) -> int:
    """The width of a causal LM's logits (a reduced head, ``specserve.engine.draft_model.ScatteredHead``,
    still returns full-vocabulary rows)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "vocab_size", None) or getattr(head, "out_features", None) or head.weight.shape[0])


def _load_pretrained(spec: str, torch_dtype: torch.dtype) -> tuple[Any, Any]:
    """Tokenizer and model of a directory (never downloads) or a hub id (transformers downloads it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import specserve.engine.draft_model  # noqa: F401  (registers the default draft's model type)
    from specserve.engine.model_registry import REGISTRY, is_registered_cache

    local = Path(spec).is_dir()
    if local and not (Path(spec) / "config.json").is_file():
        raise FailedPrecondition(f"{spec!r} is not a Hugging Face model directory (no config.json)")
    if not local and (Path(spec).exists() or spec.startswith(("/", ".", "~"))):
        raise FailedPrecondition(f"model directory {spec!r} does not exist or is not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=local, dtype=torch_dtype)
    except Exception as exc:  # safetensors, tokenizers and hub errors share no base class
        name = is_registered_cache(spec) if local else None
        if name is not None:
            raise FailedPrecondition(
                f"the registered model {name!r} in {spec!r} could not be loaded ({type(exc).__name__}: {exc}); "
                f"{REGISTRY[name].repair_hint()}"
            ) from exc
        where = "directory" if local else "hub id (is the hub reachable from here?)"
        raise FailedPrecondition(f"could not load the model {where} {spec!r}: {type(exc).__name__}: {exc}") from exc
    return tokenizer, model


def pass_timer(
    model, device: torch.device, *, context: int = 64, most: int = 8, clock: Callable[[], int] = time.perf_counter_ns
) -> Callable[[int], int]:
    """``time(k)``: ``clock`` nanoseconds of one pass of ``model`` over ``k <= most`` new positions after
    ``context`` cached tokens (fewer where the model's context is shorter), the cache cropped back after
    each pass. Shared by the kernel choice (:func:`specserve.engine.cpu_kernels.use_faster_linears`) and the
    target's start-up verify curve (``specserve/target/calibration.py``); run it where the model runs."""
    from transformers import DynamicCache

    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    context = max(1, min(context, int(limit) - most)) if limit else context
    vocab = vocab_size_of(model)
    tokens = torch.tensor([[(7919 * i + 13) % vocab for i in range(context + most)]], device=device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=tokens[:, :context], cache=cache, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def time_pass(k: int) -> int:
        if not 1 <= k <= most:
            raise ValueError(f"a timed pass feeds 1 to {most} positions, not {k}")
        start = clock()
        model(input_ids=tokens[:, context : context + k], cache=cache, use_cache=True, logits_to_keep=k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = clock() - start
        cache.crop(-k)
        return elapsed

    return time_pass


def load_model(
    path: str | Path,
    *,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    kernels: Kernels = "stock",
    warmup: bool = False,
    kernel_store: str | None = None,
) -> LoadedModel:
    """Load a causal LM (a local directory, or a hub id where the hub is reachable) onto ``device`` in
    ``dtype``, its linear layers on the ``kernels`` path (:mod:`specserve.engine.cpu_kernels`).

    ``kernel_store``: the Redis URL of a deployment whose replicas share one kernel path per kind of
    machine (:mod:`specserve.engine.kernel_choice`): with it, ``kernels="auto"`` runs the path recorded
    there for this machine's kind and this model's shape, timing both first where none is recorded.
    Without it, ``"auto"`` is the packed path wherever that applies."""
    spec = str(path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    start = time.perf_counter()
    tokenizer, model = _load_pretrained(spec, torch_dtype)
    model.to(torch_device)
    model.eval()
    model.requires_grad_(False)
    vocab_size = vocab_size_of(model)
    parameter_count = sum(p.numel() for p in model.parameters())  # before packing: packed weights are not parameters
    try:
        kernel_path = cpu_kernels.resolve(kernels, torch_device, torch_dtype)
    except ValueError as exc:
        raise FailedPrecondition(str(exc)) from None
    if kernel_path == "onednn" and kernels == "fastest":
        kernel_path, _ = cpu_kernels.use_faster_linears(model, pass_timer(model, torch_device))
    elif kernel_path == "onednn" and kernels == "auto" and kernel_store is not None:
        timer = pass_timer(model, torch_device)
        kind = kernel_choice.hardware_kind(model, "target")
        kernel_path = kernel_choice.shared_choice(kernel_store, kind, lambda: cpu_kernels.time_linears(model, timer)).kernels
        if kernel_path == "onednn":
            cpu_kernels.use_packed_linears(model)
    elif kernel_path == "onednn":
        cpu_kernels.use_packed_linears(model)
    attention.use_grouped_sdpa(model)  # on a CPU: the same bits, without copying the KV per query head
    if len(tokenizer) > vocab_size:
        raise FailedPrecondition(
            f"the tokenizer in {str(path)!r} has {len(tokenizer)} tokens but the model only {vocab_size} "
            "output rows; the directory mixes a tokenizer and a model that do not belong together"
        )
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0] if eos else None
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        dtype=torch_dtype,
        vocab_size=vocab_size,
        vocab_fingerprint=vocab_fingerprint(tokenizer),
        eos_token_id=None if eos is None else int(eos),
        parameter_count=parameter_count,
        name=spec,
    )
    if warmup:
        loaded.warmup()
    log.info(
        "model_loaded",
        model=loaded.name,
        architecture=type(model).__name__,
        device=str(torch_device),
        dtype=str(torch_dtype).removeprefix("torch."),
        parameter_count=loaded.parameter_count,
        memory_bytes=_memory_bytes(model),
        vocab_size=vocab_size,
        vocab_fingerprint=loaded.vocab_fingerprint[:12],
        load_s=round(time.perf_counter() - start, 3),
        kernels=kernel_path,
        attention=model.config._attn_implementation,
        threads=torch.get_num_threads(),  # the loading thread's: the model thread's, in a worker
        warmed_up=warmup,
    )
    return loaded
