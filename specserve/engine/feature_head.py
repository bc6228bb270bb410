"""The feature-conditioned draft head: one decoder layer that reads the target's own hidden states.

An EAGLE-style draft (Li et al. 2024, arXiv 2401.15077; training-time test
from EAGLE-3, arXiv 2503.01840). Terms:

* **feature** ``f_t``: the target's last decoder layer output at position ``t``
  (the input of its final norm), divided by its RMS: :func:`target_features`.
  ``f_t`` is what the target's head turns into the distribution of token
  ``t + 1``. The target ships it, float16, for every position it commits. A fused
  head (``FEATURE_FUSED_LAYERS``, EAGLE-3's) reads another ``f_t`` instead, made
  on the target too (:mod:`specserve.engine.feature_maker`).
* **slot** ``j`` (``j >= 1``): one position of the head's own sequence. Its input
  is ``fc([embed(x_j) ; f_{j-1}])``; its output ``h_j`` (before the final norm)
  is the head's estimate of ``f_j``, and ``head(norm(h_j))`` its distribution
  of token ``j + 1``. A slot is *true* when its input feature came from the
  target, *drafted* when it is the head's own ``h_{j-1}``.

Drafting after committed tokens ``x_0 .. x_{n-1}`` (the target holds features
``f_0 .. f_{n-2}``: the last token is pending): slots ``1 .. n-1`` are true;
slot ``n-1``'s output gives the first draft token ``y_n``; slot ``n`` takes
``(embed(y_n), h_{n-1})``, and so on. Only true slots stay in the head's cache
between rounds: a round's drafted slots are replaced by true ones once the
target has verified (and returned the features of) the accepted tokens.

The head owns its decoder layer, input projection ``fc`` and a copy of the
target's final norm. Its token embedding and output rows are the target's
(``attach_target``): they are not stored with the head. The output head covers
only ``head_size`` tokens (the target's most frequent), scattered into a
full-vocabulary row of ``-inf`` as in :mod:`specserve.engine.draft_model`: tokens
outside it have ``q = 0``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

#: The last layer's hidden state over its RMS (EAGLE-1's feature).
FEATURE_LAST_HIDDEN_RMS = "last_hidden_rms"
#: EAGLE-3's fused feature: the states of a low, a middle and the last layer, each over its RMS, concatenated and
#: projected to one ``hidden``-wide row by the head's ``fuse`` matrix (:meth:`FeatureHead.fused`).
FEATURE_FUSED_LAYERS = "fused_layers"
FEATURE_KINDS = (FEATURE_LAST_HIDDEN_RMS, FEATURE_FUSED_LAYERS)


class FeatureHeadConfig(LlamaConfig):
    """A Llama config for the head's one layer, plus what ties it to its target."""

    model_type = "specserve_feature_head"

    def __init__(
        self,
        head_size: int = 8192,
        feature: str = FEATURE_LAST_HIDDEN_RMS,
        target_model: str | None = None,
        fused_layers: list[int] | None = None,
        **kwargs,
    ) -> None:
        if feature not in FEATURE_KINDS:
            raise ValueError(f"feature must be one of {FEATURE_KINDS}, got {feature!r}")
        if (feature == FEATURE_FUSED_LAYERS) != bool(fused_layers):
            raise ValueError("fused_layers names the target's layers exactly when feature is fused_layers")
        self.head_size = head_size
        self.feature = feature
        self.fused_layers = list(fused_layers) if fused_layers else None
        self.target_model = target_model  # a registered name or a path: where the embedding comes from
        kwargs["num_hidden_layers"] = 1
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)


def feature_name(
    kind: str, hidden_size: int, layers: list[int] | None = None, fuse: torch.Tensor | None = None
) -> str:
    """What names a feature on both sides of the relay (the target's GetTargetInfo, a draft's GetDraftInfo): its
    kind, its width and, for a fused feature, its layers and a digest of the ``fuse`` matrix's values as stored
    (``[hidden, layers * hidden]``), so a target that projects with another head's matrix is caught too."""
    if kind != FEATURE_FUSED_LAYERS:
        return f"{kind} hidden={hidden_size}"
    if fuse is None or not layers:
        raise ValueError("a fused feature is named by its layers and its fuse matrix")
    digest = hashlib.sha256(fuse.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
    return f"{kind}={','.join(map(str, layers))} hidden={hidden_size} fuse={digest}"


def target_features(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """``[..., hidden]`` last-layer states (before the final norm) -> features ``[..., hidden]`` float32."""
    h = hidden.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class FinalNormInput:
    """Records the input of a model's final norm (its last layer's output) on every forward pass.

    ``with FinalNormInput(model) as tap: model(...); tap.hidden`` -> ``[batch, T, hidden]``.
    """

    def __init__(self, model: nn.Module) -> None:
        decoder = model.get_decoder()
        self.norm = getattr(decoder, "norm", None) or decoder.ln_f  # Llama-like, or GPT-2
        self.hidden: torch.Tensor | None = None
        self._handle = None

    def __enter__(self) -> FinalNormInput:
        def hook(_module, args):
            self.hidden = args[0]

        self._handle = self.norm.register_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()


def fuse_states(states: torch.Tensor, fuse: torch.Tensor, eps: float) -> torch.Tensor:
    """EAGLE-3's fused feature: ``[..., layers, hidden]`` layer states (before any norm), each over its RMS
    (:func:`target_features`), concatenated and projected by ``fuse`` ``[hidden, layers * hidden]``."""
    f = target_features(states, eps).flatten(-2)  # [..., layers * hidden] float32
    return nn.functional.linear(f.to(fuse.dtype), fuse)


def default_fused_layers(num_layers: int) -> list[int]:
    """A low, a middle and the last decoder layer of a ``num_layers``-layer target (EAGLE-3's choice of three,
    with the last layer's output as the high one: the state the target's own head reads)."""
    return [min(2, num_layers - 1), num_layers // 2, num_layers - 1]


class LayerOutputs:
    """Records the outputs of some of a model's decoder layers on every forward pass.

    ``with LayerOutputs(model, [2, 15, 29]) as tap: model(...); tap.stacked()`` -> ``[batch, T, 3, hidden]``.
    """

    def __init__(self, model: nn.Module, layers: list[int]) -> None:
        decoder = model.get_decoder()
        self.modules = [decoder.layers[i] for i in layers]
        self.outputs: list[torch.Tensor | None] = [None] * len(layers)
        self._handles: list = []

    def __enter__(self) -> LayerOutputs:
        for i, module in enumerate(self.modules):

            def hook(_module, _args, output, i=i):
                self.outputs[i] = output[0] if isinstance(output, tuple) else output

            self._handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stacked(self) -> torch.Tensor:
        """The recorded outputs, ``[batch, T, layers, hidden]``."""
        if any(o is None for o in self.outputs):
            raise RuntimeError("no forward pass recorded")
        return torch.stack([o for o in self.outputs if o is not None], dim=-2)


@dataclass
class HeadStep:
    """One pass of the head: its outputs (the next features) and logits over its own tokens."""

    hidden: torch.Tensor  # [batch, T, hidden]: h_j, the estimate of f_j (input of the next drafted slot)
    logits: torch.Tensor  # [batch, T, head_size] float32


class FeatureHead(nn.Module):
    """The head (see the module docstring). ``attach_target`` must run before use.

    ``model`` is a one-layer ``LlamaModel`` fed ``inputs_embeds`` (the slots' ``fc`` outputs), with no
    token table and no final norm (its output is ``h``, before the norm): the draft tier runs it with
    the same KV caches, packing and row-invariant passes as a token draft.
    """

    def __init__(self, config: FeatureHeadConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        # EAGLE-3's projection of the fused layers' states (FEATURE_FUSED_LAYERS); run where the features are made.
        self.fuse = nn.Linear(len(config.fused_layers) * d, d, bias=False) if config.fused_layers else None
        #: The feature it reads (:func:`feature_name`), named with its fuse matrix as its files hold it: set by
        #: :func:`load_feature_head` ("" for a head not loaded from its files).
        self.feature_name = ""
        self.model = LlamaModel(config)
        self.model.embed_tokens = None  # the target's table is attached instead
        self.model.norm = nn.Identity()
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.register_buffer("head_token_ids", torch.zeros(config.head_size, dtype=torch.long))
        # The target's tables, attached (not saved with the head).
        self.register_buffer("embedding", torch.empty(0), persistent=False)  # [vocab, hidden]
        self.register_buffer("output", torch.empty(0), persistent=False)  # [vocab, hidden]: the target's lm_head
        self.register_buffer("head_rows", torch.empty(0), persistent=False)  # [head_size, hidden]

    def attach_target(self, embedding: torch.Tensor, output: torch.Tensor | None = None) -> None:
        """Take the target's token table ``[vocab, hidden]`` and its output rows ``[vocab, hidden]`` (None:
        the target ties them to the token table)."""
        shape = (self.config.vocab_size, self.config.hidden_size)
        for name, table in (("embedding", embedding), ("output rows", output)):
            if table is not None and tuple(table.shape) != shape:
                raise ValueError(f"the target's {name} are {tuple(table.shape)}, the head expects {shape}")
        dtype = self.fc.weight.dtype
        self.embedding = embedding.detach().to(device=self.fc.weight.device, dtype=dtype)
        self.output = self.embedding if output is None else output.detach().to(self.embedding)
        self.head_rows = self.output[self.head_token_ids]

    def set_head_tokens(self, token_ids: torch.Tensor) -> None:
        """Name the head's tokens (sorted, distinct ids)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.shape != (self.config.head_size,) or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"head token ids must be {self.config.head_size} sorted distinct ids")
        self.head_token_ids.copy_(ids)
        if self.output.numel():
            self.head_rows = self.output[self.head_token_ids]

    # ---- pieces shared by serving and training -------------------------------------------

    def slot_inputs(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` tokens and ``[B, T, hidden]`` previous features -> the layer's inputs ``[B, T, hidden]``."""
        e = self.embedding[input_ids]  # [B, T, hidden]
        return self.fc(torch.cat([e, features.to(e.dtype)], dim=-1))

    def fused(self, states: torch.Tensor, eps: float) -> torch.Tensor:
        """``[..., layers, hidden]`` layer states (before any norm) -> the feature ``[..., hidden]``: each state
        over its RMS (:func:`target_features`), concatenated, through ``fuse``."""
        if self.fuse is None:
            raise ValueError("this head reads the last layer's feature, not fused layers")
        return fuse_states(states, self.fuse.weight, eps)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> ``[..., head_size]`` float32 logits over the head's tokens."""
        return nn.functional.linear(self.norm(hidden), self.head_rows).float()

    def scatter(self, small: torch.Tensor) -> torch.Tensor:
        """``[..., head_size]`` -> ``[..., vocab]`` with ``-inf`` outside the head."""
        full = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.scatter_(-1, self.head_token_ids.expand(*small.shape[:-1], -1), small)

    # ---- serving: one pass of the layer, with a cache ------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The width of a full-vocabulary row (:meth:`scatter`)."""
        return self.config.vocab_size

    def get_output_embeddings(self) -> FeatureHead:
        """What ``vocab_size_of`` (the KV-cache store) reads the logits' width from."""
        return self

    def hidden(self, input_ids: torch.Tensor, features: torch.Tensor, **model_kwargs) -> torch.Tensor:
        """The layer's outputs ``h`` ``[B, T, hidden]`` for slots ``input_ids`` ``[B, T]`` and their input
        features ``[B, T, hidden]``; ``model_kwargs`` (position ids, mask, cache, attention arguments) go
        to the ``LlamaModel``."""
        model_kwargs.setdefault("use_cache", model_kwargs.get("cache") is not None)
        return self.model(inputs_embeds=self.slot_inputs(input_ids, features), **model_kwargs).last_hidden_state


    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> HeadStep:
        """One pass over slots ``input_ids`` ``[B, T]`` with their input features ``[B, T, hidden]`` at
        ``position_ids`` ``[B, T]``; ``attention_mask`` ``[B, cached + T]`` (1 = real slot) as for a
        ``LlamaModel``; ``kwargs`` go on to the attention function."""
        h = self.hidden(
            input_ids, features, attention_mask=attention_mask, position_ids=position_ids, cache=cache, **kwargs
        )  # [B, T, hidden]: no final norm in self.model
        return HeadStep(hidden=h, logits=self.head_logits(h))

    # ---- training and evaluation: every slot, unrolled on its own outputs --------------------

    def unrolled(
        self, input_ids: torch.Tensor, features: torch.Tensor, steps: int, *, logits: bool = True
    ) -> list[HeadStep]:
        """The head run ``steps`` deep from every slot at once (the training-time test).

        ``input_ids [B, S]``: tokens ``x_1 .. x_S`` of the slots; ``features [B, S, hidden]``: the true
        features ``f_0 .. f_{S-1}`` (slot ``j``'s input feature). Step 1 is the head on true features.
        Step ``k`` gives, at slot ``j``, what drafting gives at its ``k``-th token when the last true
        slot is ``j - k + 1`` and the drafted tokens are ``x_{j-k+2} .. x_j``: it attends to true slots
        up to ``j - k + 1`` and to its own chain's drafted slots, and its input feature is step
        ``k - 1``'s output at slot ``j - 1``. Slots with ``j - k + 1 < 1`` have no such chain (their
        outputs at step ``k`` mean nothing: mask them out of losses). ``logits=False``: outputs only (a
        caller that needs logits at some slots computes them with :meth:`head_logits`).
        """
        layer = self.model.layers[0]
        attn = layer.self_attn
        B, S = input_ids.shape
        n_heads, n_kv = self.config.num_attention_heads, self.config.num_key_value_heads
        head_dim = attn.head_dim
        positions = torch.arange(1, S + 1, device=input_ids.device).expand(B, S)
        e = self.embedding[input_ids]  # [B, S, hidden]
        cos, sin = self.model.rotary_emb(e, position_ids=positions)
        keys: list[torch.Tensor] = []  # per step: [B, n_kv, S, head_dim]
        values: list[torch.Tensor] = []
        out: list[HeadStep] = []
        feats = features
        for _k in range(1, steps + 1):
            x = self.fc(torch.cat([e, feats.to(e.dtype)], dim=-1))  # [B, S, hidden]
            normed = layer.input_layernorm(x)
            q = attn.q_proj(normed).view(B, S, n_heads, head_dim).transpose(1, 2)
            kk = attn.k_proj(normed).view(B, S, n_kv, head_dim).transpose(1, 2)
            v = attn.v_proj(normed).view(B, S, n_kv, head_dim).transpose(1, 2)
            q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
            keys.append(kk)
            values.append(v)
            ctx = _unrolled_attention(q, keys, values, attn.scaling)  # [B, n_heads, S, head_dim]
            ctx = ctx.transpose(1, 2).reshape(B, S, n_heads * head_dim)
            h = x + attn.o_proj(ctx)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            out.append(HeadStep(hidden=h, logits=self.head_logits(h) if logits else h.new_empty(0)))
            # Step k + 1's input at slot j is this step's output at slot j - 1.
            feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        return out


def _unrolled_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float
) -> torch.Tensor:
    """Step ``k = len(keys)`` of :meth:`FeatureHead.unrolled`'s attention.

    ``q [B, H, S, D]``; ``keys[s], values[s] [B, Hkv, S, D]`` for steps ``1 .. k``. Query slot ``j``
    attends to step 1's slots ``<= j - k + 1`` and to step ``s``'s slot ``j - k + s`` for ``s >= 2``.
    """
    k = len(keys)
    _B, H, S, _D = q.shape
    group = H // keys[0].shape[1]
    k1 = keys[0].repeat_interleave(group, dim=1)  # [B, H, S, D]
    v1 = values[0].repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k1.transpose(-1, -2)).float() * scaling  # [B, H, S, S]
    query = torch.arange(S, device=q.device)
    allowed = query.unsqueeze(0) <= (query.unsqueeze(1) - (k - 1))  # [S(query), S(key)]
    scores = scores.masked_fill(~allowed, float("-inf"))
    diag_scores, diag_values = [], []
    for s in range(2, k + 1):
        shift = k - s  # slot j reads step s at j - shift
        ks = _shift_right(keys[s - 1], shift).repeat_interleave(group, dim=1)  # [B, H, S, D]
        vs = _shift_right(values[s - 1], shift).repeat_interleave(group, dim=1)
        d = (q * ks).sum(-1).float() * scaling  # [B, H, S]
        if shift:
            d[..., :shift] = float("-inf")
        diag_scores.append(d.unsqueeze(-1))
        diag_values.append(vs)
    allscores = torch.cat([scores, *diag_scores], dim=-1)  # [B, H, S, S + k - 1]
    # Rows with no key at all (only possible at k = 1, slot 0 never: slot j always sees itself) stay finite.
    probs = torch.softmax(allscores, dim=-1).to(q.dtype)
    ctx = torch.matmul(probs[..., :S], v1)  # [B, H, S, D]
    for i, vs in enumerate(diag_values):
        ctx = ctx + probs[..., S + i].unsqueeze(-1) * vs
    return ctx


def _shift_right(x: torch.Tensor, by: int) -> torch.Tensor:
    """``[B, H, S, D]`` with slot ``j`` holding ``x[..., j - by, :]`` (zeros before the start)."""
    if by == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :by]), x[:, :, :-by]], dim=2)


def head_from_target(
    target: nn.Module,
    head_token_ids: torch.Tensor,
    *,
    target_model: str | None = None,
    fused_layers: list[int] | None = None,
):
    """A fresh head shaped like ``target``'s layers, its final norm copied, its tables attached; ``fused_layers``:
    the target layers of an EAGLE-3 fused feature (None: the last layer's feature)."""
    settings = target.config.to_dict()
    for key in ("quantization_config", "model_type", "architectures", "auto_map", "tie_word_embeddings"):
        settings.pop(key, None)
    settings["num_hidden_layers"] = 1
    ids = torch.as_tensor(head_token_ids, dtype=torch.long)
    feature = FEATURE_FUSED_LAYERS if fused_layers else FEATURE_LAST_HIDDEN_RMS
    config = FeatureHeadConfig(
        head_size=len(ids), target_model=target_model, feature=feature, fused_layers=fused_layers, **settings
    )
    head = FeatureHead(config)
    _init(head, config.initializer_range)
    with torch.no_grad():
        head.norm.weight.copy_(target.get_decoder().norm.weight.float())
    head.head_token_ids.copy_(ids)
    embedding, output = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    head.attach_target(embedding.float(), None if output is embedding else output.float())
    return head


def _init(head: FeatureHead, std: float) -> None:
    """Small random layer whose outputs start near zero, and ``fc`` near "pass the feature through": the
    head starts by estimating ``f_j`` as ``f_{j-1}``, and training moves it from there."""
    d = head.config.hidden_size
    with torch.no_grad():
        for name, p in head.model.layers[0].named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std * (0.1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0))
        head.fc.weight.normal_(0.0, std / math.sqrt(2))
        head.fc.weight[:, d:] += torch.eye(d)
        if head.fuse is not None:  # starts as the last layer's feature alone: a last-layer head's weights fit it
            head.fuse.weight.zero_()
            head.fuse.weight[:, -d:] = torch.eye(d)


# ---- the head on disk ----------------------------------------------------------------------------

#: The head's weights file in its directory (its config is ``config.json`` beside it).
WEIGHTS = "model.safetensors"


def save_feature_head(head: FeatureHead, directory: str | Path, *, dtype: torch.dtype = torch.float16) -> None:
    """Write the head's own tensors (not the target's tables) and its config to ``directory``."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in head.state_dict().items()
    }
    save_file(tensors, str(out / WEIGHTS))
    head.config.to_json_file(str(out / "config.json"))


def load_feature_head(
    directory: str | Path,
    *,
    target: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> FeatureHead:
    """A head from ``directory``, its target's token table attached.

    ``target``: the target model's directory or registered name (None: the head's ``target_model``); only
    its token table is read. Raises :class:`FailedPrecondition` when the files or the shapes do not fit.
    """
    from safetensors.torch import load_file

    from specserve.api.errors import FailedPrecondition
    from specserve.engine.model_registry import resolve_model

    path = Path(directory)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        raise FailedPrecondition(f"{path} is not a feature head directory (config.json and {WEIGHTS})")
    config = FeatureHeadConfig.from_json_file(str(path / "config.json"))
    spec = target if target is not None else config.target_model
    if spec is None:
        raise FailedPrecondition(f"the feature head at {path} names no target: pass the target model")
    head = FeatureHead(config)
    state = load_file(str(path / WEIGHTS))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("inv_freq")]:
        raise FailedPrecondition(f"{path}: weights do not fit the head (missing {missing}, unexpected {unexpected})")
    fuse = state.get("fuse.weight")  # as stored: the target names the feature from the same file
    head.feature_name = feature_name(config.feature, config.hidden_size, config.fused_layers, fuse)
    head.to(device=device, dtype=dtype).eval()
    head.attach_target(*_token_tables(Path(resolve_model(str(spec), progress=False))))
    return head


def _token_tables(target: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``([vocab, hidden], [vocab, hidden] | None)``: the target's input embedding and its own output rows
    (None where it ties them to the embedding), read from its safetensors files alone."""
    import json

    from safetensors import safe_open

    from specserve.api.errors import FailedPrecondition

    index = target / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None

    def tensor(key: str) -> torch.Tensor | None:
        name = WEIGHTS if weight_map is None else weight_map.get(key)
        if name is None or not (target / name).is_file():
            return None
        with safe_open(str(target / name), framework="pt") as f:
            return f.get_tensor(key).float() if key in f.keys() else None

    embedding = tensor("model.embed_tokens.weight")
    if embedding is None:
        raise FailedPrecondition(f"the target at {target} has no model.embed_tokens.weight in safetensors files")
    return embedding, tensor("lm_head.weight")
