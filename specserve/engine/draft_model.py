"""The default pair's draft architecture: a slice of the target, with a cheap embedding and a cheap head.

On a CPU the full-vocabulary parts dominate a small draft: a 49,152 x 576 head
costs more than two decoder layers, and the embedding table alone is 113 MB in
float32. :class:`SpecserveDraftForCausalLM` is a ``LlamaForCausalLM`` whose

* output head covers only ``head_size`` tokens (the ones the target emits most)
  and scatters their logits into a full-vocabulary row whose other entries are
  ``-inf`` (:class:`ScatteredHead`), so the model still returns ``[..., vocab]``
  logits: Hugging Face assisted generation (``assistant_model=``) and the draft
  service use it unchanged, and tokens outside the head simply have ``q = 0``
  (never proposed; exactness needs nothing more);
* input embedding (:class:`DraftEmbedding`) shares the head's rows for those
  tokens (the target ties its embedding and head too) and maps every other
  token through a low-rank table (``embed_rank``) initialised from the SVD of
  the target's embedding.

It loads with ``AutoModelForCausalLM.from_pretrained(path)`` once this module
is imported (it registers the ``specserve_draft`` model type);
:func:`specserve.engine.models.load_model` imports it. :func:`draft_from_target`
builds one from a target (``scripts/distill_draft.py`` trains it).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class SpecserveDraftConfig(LlamaConfig):
    """A Llama config plus the sizes of the reduced head and the low-rank embedding."""

    model_type = "specserve_draft"

    def __init__(self, head_size: int = 8192, embed_rank: int = 128, **kwargs) -> None:
        self.head_size = head_size
        self.embed_rank = embed_rank
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)


class DraftEmbedding(nn.Module):
    """``ids [...] -> [..., hidden]``: exact rows for the head's tokens, a low-rank map for the rest.

    ``rows`` (``[head_size, hidden]``) are the embeddings of the ``head_size``
    tokens the target emits most (``token_ids``, sorted), and also the output
    head's weights (:class:`ScatteredHead` reads them: input and output share
    them, as the target's do). Any other token goes through ``codes``
    (``[vocab, rank]``) and ``up`` (``rank -> hidden``).
    """

    def __init__(self, vocab_size: int, head_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.empty(head_size, hidden_size))
        self.codes = nn.Embedding(vocab_size, rank)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        self.register_buffer("token_ids", torch.zeros(head_size, dtype=torch.long))
        self.register_buffer("slot", torch.full((vocab_size,), -1, dtype=torch.long))  # id -> row, or -1

    def set_tokens(self, token_ids: torch.Tensor) -> None:
        """Name the head's tokens (sorted, distinct ids)."""
        self.token_ids.copy_(token_ids)
        self.slot.fill_(-1)
        self.slot[token_ids] = torch.arange(len(token_ids), device=self.slot.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        slot = self.slot[input_ids]  # [...]
        low = self.up(self.codes(input_ids))  # [..., hidden]
        exact = self.rows[slot.clamp(min=0)]  # [..., hidden]
        return torch.where((slot >= 0).unsqueeze(-1), exact.to(low.dtype), low)


class ScatteredHead(nn.Module):
    """Logits for the embedding's ``head_size`` tokens, scattered into a ``[..., vocab]`` row of ``-inf``.

    It owns no weights: it projects onto :class:`DraftEmbedding`'s ``rows``.
    """

    def __init__(self, embedding: DraftEmbedding, vocab_size: int) -> None:
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)  # a reference, not a submodule: no second copy
        self.vocab_size = vocab_size

    @property
    def weight(self) -> torch.Tensor:
        """``[head_size, hidden]``: row ``i`` gives the logit of ``token_ids[i]``."""
        return self._embedding.rows

    @property
    def token_ids(self) -> torch.Tensor:
        return self._embedding.token_ids

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., head_size]``: the head's own logits."""
        return nn.functional.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.project(hidden)  # [..., head_size]
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))  # [..., vocab]
        return full.scatter_(-1, self.token_ids.expand(*small.shape[:-1], -1), small)


class SpecserveDraftForCausalLM(LlamaForCausalLM):
    """A Llama causal LM with :class:`DraftEmbedding` and :class:`ScatteredHead` (see the module docstring)."""

    config_class = SpecserveDraftConfig
    _tied_weights_keys: dict[str, str] = {}  # noqa: RUF012 (transformers reads this class attribute)

    def __init__(self, config: SpecserveDraftConfig) -> None:
        super().__init__(config)
        embedding = DraftEmbedding(config.vocab_size, config.head_size, config.embed_rank, config.hidden_size)
        self.model.embed_tokens = embedding
        self.lm_head = ScatteredHead(embedding, config.vocab_size)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, DraftEmbedding):
            nn.init.normal_(module.rows, std=self.config.initializer_range)
        super()._init_weights(module)


AutoConfig.register(SpecserveDraftConfig.model_type, SpecserveDraftConfig, exist_ok=True)
AutoModelForCausalLM.register(SpecserveDraftConfig, SpecserveDraftForCausalLM, exist_ok=True)


@torch.no_grad()
def draft_from_target(
    target: LlamaForCausalLM, *, layers: int, head_token_ids: torch.Tensor, embed_rank: int
) -> SpecserveDraftForCausalLM:
    """A draft made of the target's first ``layers`` decoder layers and final norm.

    The head, and the embedding of its tokens, are the target's output rows of
    ``head_token_ids`` (sorted, distinct); every other token's embedding is the
    rank-``embed_rank`` truncated SVD of the target's.
    """
    ids = torch.as_tensor(head_token_ids, dtype=torch.long)
    if ids.dim() != 1 or not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("head_token_ids must be a sorted 1-D tensor of distinct ids")
    settings = target.config.to_dict()
    for key in ("quantization_config", "model_type", "architectures", "auto_map", "tie_word_embeddings"):
        settings.pop(key, None)
    settings["num_hidden_layers"] = layers
    config = SpecserveDraftConfig(head_size=len(ids), embed_rank=embed_rank, **settings)
    draft = SpecserveDraftForCausalLM(config)
    for i in range(layers):
        draft.model.layers[i].load_state_dict(target.model.layers[i].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    table = target.get_input_embeddings().weight.float()  # [vocab, hidden]
    u, s, vh = torch.linalg.svd(table, full_matrices=False)  # [vocab, hidden], [hidden], [hidden, hidden]
    embedding = draft.model.embed_tokens
    embedding.codes.weight.copy_(u[:, :embed_rank] * s[:embed_rank])  # [vocab, rank]
    embedding.up.weight.copy_(vh[:embed_rank].T)  # [hidden, rank]
    embedding.rows.copy_(target.get_output_embeddings().weight[ids].float())  # [head, hidden]
    embedding.set_tokens(ids)
    return draft
