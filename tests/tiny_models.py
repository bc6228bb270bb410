"""Tiny real Hugging Face models and a tiny tokenizer, saved to disk, for every team's tests.

Everything here is built offline from small configs with fixed seeds, so a test
gets real ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` classes and a real
``PreTrainedTokenizerFast`` that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load with ``local_files_only=True``.

Stable API (others depend on it; extend, do not change)::

    make_tiny_pair(tmp_path, vocab_size=384, arch="llama", seed=0) -> (target_dir, draft_dir)
    make_tiny_tokenizer(out_dir, vocab_size=384, corpus=CORPUS, chat_template=CHAT_TEMPLATE)
        -> PreTrainedTokenizerFast
    make_tiny_model(out_dir, arch="llama", vocab_size=384, seed=0, size="draft") -> Path

* ``target_dir`` and ``draft_dir`` are ``tmp_path / "target"`` and ``tmp_path / "draft"``;
  each holds a float32 model and the same tokenizer, so the pair shares one
  vocabulary. The target is a little larger than the draft and the two have
  different weights (seeds ``seed`` and ``seed + 1``).
* The tokenizer is a byte-level BPE trained on :data:`CORPUS`; it has at most
  ``vocab_size`` tokens (``<|endoftext|>`` is id 0 and is EOS/BOS/PAD). The
  models' output layer has exactly ``vocab_size`` rows.
* The tokenizer carries :data:`CHAT_TEMPLATE` (``role: content`` lines, then
  ``assistant:``), so chat requests work; ``chat_template=None`` leaves it out.
* ``arch`` is ``"llama"`` (grouped-query attention, RoPE) or ``"gpt2"``
  (learned positions). Weights use a wider initialisation than the default so
  that logits are not near ties (greedy tests stay well conditioned).

Put ``tests/`` on ``sys.path`` (``tests/conftest.py`` does) and ``import tiny_models``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

EOS = "<|endoftext|>"

#: Text the tiny tokenizer is trained on (repetitive code-like lines).
CORPUS: tuple[str, ...] = (
    "def add(a, b):\n    return a + b\n",
    "def sub(a, b):\n    return a - b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "the quick brown fox jumps over the lazy dog",
    "import os\nimport sys\nprint(sys.argv)\n",
    "if x is None:\n    raise ValueError('x must not be None')\n",
    "while True:\n    break\n",
)

#: A minimal chat template (Jinja, as in ``tokenizer_config.json``): one ``role: content`` line per
#: message, then ``assistant:`` when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant:{% endif %}"
)

Arch = Literal["llama", "gpt2"]
Size = Literal["draft", "target"]

_SIZES: dict[str, dict[str, int]] = {
    "draft": {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 64},
    "target": {"hidden": 48, "layers": 3, "heads": 4, "kv_heads": 2, "ffn": 96},
}


def make_tiny_tokenizer(
    out_dir: Path,
    vocab_size: int = 384,
    corpus: Sequence[str] = CORPUS,
    chat_template: str | None = CHAT_TEMPLATE,
):
    """Train a byte-level BPE on ``corpus`` and save it as a ``PreTrainedTokenizerFast``.

    A different ``corpus`` gives a different token table (for vocabulary-mismatch tests).
    ``chat_template`` (None: none) is saved with it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    if chat_template is not None:
        fast.chat_template = chat_template
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def _config(arch: Arch, vocab_size: int, size: Size, eos_id: int):
    from transformers import GPT2Config, LlamaConfig

    s = _SIZES[size]
    if arch == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=s["hidden"],
            intermediate_size=s["ffn"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            max_position_embeddings=512,
            initializer_range=0.2,
            tie_word_embeddings=False,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=s["hidden"],
            n_layer=s["layers"],
            n_head=s["heads"],
            n_inner=s["ffn"],
            n_positions=512,
            initializer_range=0.2,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")


def make_tiny_model(
    out_dir: Path, arch: Arch = "llama", vocab_size: int = 384, seed: int = 0, size: Size = "draft"
) -> Path:
    """Build a randomly initialised tiny causal LM (fixed seed) and save it in float32 to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(arch, vocab_size, size, eos_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_tiny_pair(
    tmp_path: Path, vocab_size: int = 384, arch: Arch = "llama", seed: int = 0
) -> tuple[Path, Path]:
    """Save a tiny target and draft sharing one tokenizer under ``tmp_path``; return their directories."""
    tmp_path = Path(tmp_path)
    target_dir = tmp_path / "target"
    draft_dir = tmp_path / "draft"
    for out_dir, size, model_seed in ((target_dir, "target", seed), (draft_dir, "draft", seed + 1)):
        make_tiny_tokenizer(out_dir, vocab_size)
        make_tiny_model(out_dir, arch=arch, vocab_size=vocab_size, seed=model_seed, size=size)
    return target_dir, draft_dir
