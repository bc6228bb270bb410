"""Helpers for system tests: a tiny model pair, a local stack on the shared Redis, a raw gRPC client.

Importable from any test module (``tests/`` is on ``sys.path``)::

    import system_fixtures as sf

    pytestmark = pytest.mark.asyncio(loop_scope="module")

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def stack(redis_server, tmp_path_factory):
        pair = sf.tiny_pair(tmp_path_factory)
        async with sf.local_stack(pair, redis_server.url) as s:
            yield s

    async def test_x(stack):
        out = await sf.generate(stack.address, sf.request([5, 6, 7], max_new_tokens=8))

The client here is raw gRPC (not the SDK), so coordinator tests do not depend
on the SDK. Everything runs in float32 on CPU (greedy equality needs float32).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import tiny_models

from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

_PAIRS: dict[tuple, TinyPair] = {}
_MODELS: dict[Path, Any] = {}


@dataclass(frozen=True)
class TinyPair:
    target_dir: Path
    draft_dir: Path

    @property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.target_dir, local_files_only=True)


def tiny_pair(tmp_path_factory, *, vocab_size: int = 384, arch: str = "llama", seed: int = 0) -> TinyPair:
    """A tiny target/draft pair saved once per test session per (vocab_size, arch, seed)."""
    key = (vocab_size, arch, seed)
    if key not in _PAIRS:
        root = tmp_path_factory.mktemp(f"pair-{arch}-{vocab_size}-{seed}")
        target_dir, draft_dir = tiny_models.make_tiny_pair(root, vocab_size=vocab_size, arch=arch, seed=seed)
        _PAIRS[key] = TinyPair(target_dir, draft_dir)
    return _PAIRS[key]


def poisoned_copy(model_dir: Path, out_dir: Path, *, position: int) -> Path:
    """A copy of a GPT-2 model directory whose learned position embedding ``position`` is NaN: a real model
    that gives NaN logits to every row of a sequence reaching that position, and normal ones otherwise."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, out_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        model.transformer.wpe.weight[position] = float("nan")
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def load_reference(model_dir: Path):
    """The model as plain transformers loads it (float32, eval), cached per directory."""
    if model_dir not in _MODELS:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        model.eval()
        _MODELS[model_dir] = model
    return _MODELS[model_dir]


def reference_greedy(
    model_dir: Path,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int = 0,
    ignore_eos: bool = False,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
) -> list[int]:
    """The target's own ``generate(do_sample=False)``, cut after its first EOS (unless ``ignore_eos``);
    ``min_new_tokens``: EOS masked until then (Hugging Face's ``MinNewTokensLengthLogitsProcessor``)."""
    import torch
    from transformers import GenerationConfig

    model = load_reference(model_dir)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None if ignore_eos else eos_token_id,
        pad_token_id=eos_token_id,
        repetition_penalty=repetition_penalty,
        min_new_tokens=min_new_tokens or None,
    )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    new = out[0, len(prompt) :].tolist()
    if not ignore_eos and eos_token_id in new:
        new = new[: new.index(eos_token_id) + 1]
    return new


def reference_constrained(pair: Any, prompt: Sequence[int], constraint: Any, max_new_tokens: int, *, eos_token_id: int = 0) -> list[int]:
    """Target-alone constrained greedy decoding: ``generate(do_sample=False)`` with the grammar engine's logits
    processor (specserve.engine.grammar), cut after the first EOS."""
    import torch
    from transformers import LogitsProcessorList

    from specserve.engine.grammar import GrammarEngine, GrammarLogitsProcessor

    model = load_reference(pair.target_dir)
    engine = GrammarEngine(pair.tokenizer, model.config.vocab_size, [eos_token_id])
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
            logits_processor=LogitsProcessorList([GrammarLogitsProcessor(engine, constraint, len(prompt))]),
        )[0, len(prompt) :].tolist()
    return out[: out.index(eos_token_id) + 1] if eos_token_id in out else out


def reference_coupled(
    model_dir: Path,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    seed: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    eos_token_id: int | None = None,
) -> list[int]:
    """The target's own Gumbel-max sampling, ``y_j = argmax(log p_j + G_j)``, from Hugging Face logits.

    A plain decoding loop over the model with a ``DynamicCache``: the next-token logits
    processed by HF's own processors (repetition penalty, temperature, top-k, top-p, in
    ``generate()``'s order), turned into ``log p`` in float64, plus
    ``specserve.core.rng.gumbel_noise(seed, j)`` of the position ``j`` being decided; the argmax is
    the token. EOS is an ordinary token (``ignore_eos``) unless ``eos_token_id`` is given: then the
    tokens are cut after the first one, and ``min_new_tokens`` masks it until then (HF's
    ``MinNewTokensLengthLogitsProcessor``, first).
    """
    import torch
    from transformers import (
        DynamicCache,
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from specserve.core.rng import gumbel_noise

    processors = LogitsProcessorList()
    if min_new_tokens:
        from transformers import MinNewTokensLengthLogitsProcessor

        assert eos_token_id is not None, "min_new_tokens masks eos_token_id"
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), min_new_tokens, eos_token_id))
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    model = load_reference(model_dir)
    ids = torch.tensor([list(prompt)], dtype=torch.long)  # [1, j]
    cache = DynamicCache(config=model.config)
    feed = ids
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=feed, cache=cache, use_cache=True).logits[:, -1].float()
            scores = processors(ids, logits)  # [1, vocab], removed tokens -inf
            noise = gumbel_noise([seed], [ids.shape[1]], scores.shape[-1])  # the token at index j
            token = torch.argmax(torch.log_softmax(scores.double(), dim=-1) + noise, dim=-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            feed = token
            if eos_token_id is not None and int(token) == eos_token_id:
                break
    return ids[0, len(prompt) :].tolist()


def reference_logprobs(
    model_dir: Path,
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
) -> list[Any]:
    """For each token of ``completion``: ``[vocab]`` float64 log-probabilities of the target's processed
    distribution at its position, by Hugging Face's own processors on one plain forward pass over prompt +
    completion (no cache). The processing is ``generate()``'s: the repetition penalty, then (sampling only)
    temperature, top-k, top-p; greedy (temperature 0) takes the penalised logits at temperature 1."""
    import torch
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature > 0:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
    model = load_reference(model_dir)
    ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.long)  # [1, n]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [n, vocab]
    out = []
    for i in range(len(completion)):
        at = len(prompt) + i  # the row predicting completion[i]
        scores = processors(ids[:, :at], logits[at - 1 : at])  # [1, vocab]
        out.append(torch.log_softmax(scores.double(), dim=-1)[0])
    return out


def check_logprobs(entries: Sequence[Any], completion: Sequence[int], reference: Sequence[Any], top_n: int) -> None:
    """``entries`` (PositionLogprobs, or their proto) are ``completion``'s tokens with the reference's log
    probabilities to 1e-4, and its ``top_n`` most likely tokens in order (probability-0 tokens left out)."""
    import math

    import torch

    assert len(entries) == len(completion) == len(reference)
    for i, (entry, token, want) in enumerate(zip(entries, completion, reference, strict=True)):
        assert entry.token_id == token, i
        assert abs(entry.logprob - float(want[token])) <= 1e-4, (i, entry.logprob, float(want[token]))
        top = torch.topk(want, top_n)
        expected = [(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True) if v > -math.inf]
        got = [(t.token_id, t.logprob) for t in entry.top_logprobs]
        assert [t for t, _ in got] == [t for t, _ in expected], i
        assert all(abs(g - w) <= 1e-4 for (_, g), (_, w) in zip(got, expected, strict=True)), i


@contextlib.asynccontextmanager
async def local_stack(pair: TinyPair, redis_url: str, **kwargs: Any) -> AsyncIterator[Any]:
    """A :class:`specserve.launch.local.LocalStack` on loopback, float32 on CPU, stopped on exit."""
    from specserve.launch.local import start_local_stack

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    # The tests compare each stream with its session's log in Redis after the session has ended, so the
    # log is kept; the default (deleted at the end) is tests/security/test_session_churn.py's. The
    # statistical tests start thousands of sessions from one client as fast as the stack serves them, at
    # the default limits: an unauthenticated client has no per-client rate (tests/security/test_client_limits.py).
    kwargs["coordinator_overrides"] = {
        "keep_ended_sessions_s": 600.0,
        **kwargs.get("coordinator_overrides", {}),
    }
    overrides = {"warmup": False, **kwargs.pop("worker_overrides", {})}
    # The target on PyTorch's stock kernels (in invariant passes, the default), as the references here
    # (load_reference) are; tests/specserve/coordinator/test_rounds_invariant.py runs the default kernels ("auto").
    target = {**overrides, "kernels": "stock", **kwargs.pop("target_overrides", {})}
    stack = await start_local_stack(
        target_model=pair.target_dir,
        draft_model=pair.draft_dir,
        redis_url=redis_url,
        target_overrides=target,
        draft_overrides={**overrides, **kwargs.pop("draft_overrides", {})},
        **kwargs,
    )
    try:
        yield stack
    finally:
        await stack.stop(grace=0.5)


def request(
    prompt: Sequence[int] | str,
    *,
    max_new_tokens: int = 24,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    gamma: int | None = None,
    proposer: int = common_pb2.PROPOSER_KIND_MODEL,
    ignore_eos: bool = False,
    stop_strings: Sequence[str] = (),
    draft_top_k: int = 0,
    sampling_mode: int = common_pb2.SAMPLING_MODE_UNSPECIFIED,
    repetition_penalty: float | None = None,
    min_confidence: float | None = None,
) -> coordinator_pb2.GenerateRequest:
    """A GenerateRequest built field by field (no SDK)."""
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, sampling_mode=sampling_mode)
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    speculation = coordinator_pb2.SpeculationParams(proposer=proposer, draft_top_k=draft_top_k)
    if gamma is not None:
        speculation.gamma = gamma
    if min_confidence is not None:
        speculation.min_confidence = min_confidence
    req = coordinator_pb2.GenerateRequest(
        sampling=sampling,
        stop=common_pb2.StopConditions(
            max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop_strings=list(stop_strings)
        ),
        speculation=speculation,
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokens.token_ids.extend(prompt)
    return req


@dataclass
class Generated:
    """What a client received: every chunk's tokens and text, and the closing stats."""

    chunks: list[coordinator_pb2.TokenChunk]
    stats: coordinator_pb2.GenerationStats | None

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


async def generate(
    address: str,
    req: coordinator_pb2.GenerateRequest,
    *,
    timeout_s: float = 60.0,
    metadata: Sequence[tuple[str, str]] = (),
) -> Generated:
    """Run one Generate call to completion on a fresh channel (with ``metadata``)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        chunks: list[coordinator_pb2.TokenChunk] = []
        stats = None
        async for reply in stub.Generate(req, timeout=timeout_s, metadata=tuple(metadata)):
            if stats is not None:
                raise AssertionError("a message arrived after the stats")
            if reply.WhichOneof("event") == "chunk":
                chunks.append(reply.chunk)
            else:
                stats = reply.stats
        return Generated(chunks, stats)


def tiny_vocab_pair(
    tmp_path_factory, *, vocab_size: int = 6, seed: int = 0, chat_template: str | None = None
) -> TinyPair:
    """A target and a draft with a ``vocab_size``-token word-level vocabulary (``<|endoftext|>`` = 0),
    small enough that every short continuation can be enumerated. Token ``i`` is the character
    ``chr(ord("a") + i - 1)``; text decodes with a space between tokens, so decoding a sequence without
    EOS and encoding the text again gives the same tokens. ``chat_template``: saved with the tokenizer."""
    key = ("tiny-vocab", vocab_size, seed, chat_template)
    if key in _PAIRS:
        return _PAIRS[key]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tiny_models.EOS: 0, **{chr(ord("a") + i): i + 1 for i in range(vocab_size - 1)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=tiny_models.EOS))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=tiny_models.EOS, bos_token=tiny_models.EOS, pad_token=tiny_models.EOS
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    root = tmp_path_factory.mktemp(f"tiny-vocab-{vocab_size}-{seed}{'-chat' if chat_template else ''}")
    dirs = []
    for name, size, model_seed in (("target", "target", seed), ("draft", "draft", seed + 1)):
        out = root / name
        fast.save_pretrained(out)
        tiny_models.make_tiny_model(out, arch="llama", vocab_size=vocab_size, seed=model_seed, size=size)
        dirs.append(out)
    _PAIRS[key] = TinyPair(dirs[0], dirs[1])
    return _PAIRS[key]


def exact_joint(
    model_dir: Path, prompt: Sequence[int], params: Any, length: int
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` generated tokens) under target-only sampling with ``params``
    (``specserve.core.sampling.logits_to_probs``: the same processing), by enumeration; EOS is an ordinary token."""
    import torch

    from specserve.core.sampling import logits_to_probs

    model = load_reference(model_dir)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        prefixes = [p for p, mass in joint.items() if mass > 0]
        ids = torch.tensor([list(prompt) + list(p) for p in prefixes], dtype=torch.long)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1, :].float()  # [n_prefixes, vocab]
        probs = logits_to_probs(
            logits, params, [list(prompt) + list(p) for p in prefixes]
        )  # [n_prefixes, vocab]
        joint = {
            (*p, t): joint[p] * float(probs[i, t])
            for i, p in enumerate(prefixes)
            for t in range(probs.shape[1])
            if probs[i, t] > 0
        }
    return joint


def merged_chi_square(observed: Mapping[tuple[int, ...], int], expected_p: Mapping[tuple[int, ...], float]) -> tuple[float, float, int]:
    """Chi-square statistic, p-value and number of cells after merging cells with expected < 5."""
    n = sum(observed.values())
    cells = sorted(expected_p, key=lambda k: expected_p[k])
    obs, exp = [], []
    acc_o = acc_e = 0.0
    for key in cells:
        acc_o += observed.get(key, 0)
        acc_e += expected_p[key] * n
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:  # leftover small mass joins the last merged cell
        obs[-1] += acc_o
        exp[-1] += acc_e
    from scipy.stats import chisquare

    stat, p = chisquare(obs, exp)
    return float(stat), float(p), len(obs)


# ---- the feature head ------------------------------------------------------------------------------

_HEADS: dict[tuple, Path] = {}


def tiny_head(
    pair: TinyPair,
    tmp_path_factory,
    prompts: Sequence[Sequence[int]],
    *,
    length: int = 32,
    steps: int = 60,
    fused_layers: Sequence[int] | None = None,
) -> Path:
    """A feature head for ``pair``'s target, saved once per test session: trained (``steps`` Adam steps, two
    unrolled steps, cross-entropy on the target's token) on the target's own greedy continuations of
    ``prompts`` (``length`` tokens, EOS an ordinary token). A tiny random target's text does not generalise,
    so the head knows these continuations only: on them its proposals are accepted and every path of the
    head runs; elsewhere it is simply a poor draft (exactness never depends on the draft). ``fused_layers``:
    a fused head (EAGLE-3's feature) of those target layers, its ``fuse`` trained with it."""
    key = (pair.target_dir, tuple(map(tuple, prompts)), length, steps, tuple(fused_layers or ()))
    if key in _HEADS:
        return _HEADS[key]
    import torch

    from specserve.engine.feature_head import LayerOutputs, head_from_target, target_features

    torch.manual_seed(0)
    target = load_reference(pair.target_dir)
    vocab = target.config.vocab_size
    eps = target.config.rms_norm_eps
    layers = list(fused_layers or [target.config.num_hidden_layers - 1])  # the last layer's: its feature
    data = []
    for prompt in prompts:
        seq = torch.tensor([[*prompt, *reference_greedy(pair.target_dir, prompt, length, ignore_eos=True)]])
        with torch.no_grad(), LayerOutputs(target, layers) as tap:
            target.get_decoder()(input_ids=seq[:, :-1])
        # slot j takes x_j and f_{j-1} and predicts x_{j+1}
        data.append((seq[:, 1:-1], tap.stacked()[:, :-1], seq[:, 2:]))
    head = head_from_target(
        target, torch.arange(vocab), target_model=str(pair.target_dir), fused_layers=list(fused_layers or []) or None
    )
    head.train()
    opt = torch.optim.Adam([p for n, p in head.named_parameters() if n != "norm.weight"], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        for inputs, states, labels in data:
            feats = head.fused(states, eps) if fused_layers else target_features(states[..., -1, :], eps)
            chain = head.unrolled(inputs, feats, 2)  # step k: a chain k deep, from slot k - 1 on
            sum(
                torch.nn.functional.cross_entropy(step.logits[0, k:], labels[0, k:]) for k, step in enumerate(chain)
            ).backward()
        opt.step()
    out = tmp_path_factory.mktemp("feature-head")
    from specserve.engine.feature_head import save_feature_head

    save_feature_head(head.eval(), out, dtype=torch.float32)
    _HEADS[key] = out
    return out


def head_overrides(pair: TinyPair, head_dir: Path) -> dict[str, str]:
    """Draft settings that serve ``head_dir`` with ``pair``'s target's token tables."""
    return {"feature_head": str(head_dir), "feature_head_target": str(pair.target_dir)}
