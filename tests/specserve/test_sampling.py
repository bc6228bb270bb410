"""Logits processing equals Hugging Face ``generate()``'s; sampling and distribution checks.

The reference is transformers itself: the processor list that
``GenerationMixin._get_logits_processor`` builds for a real (tiny)
``LlamaForCausalLM`` from a ``GenerationConfig``, and the processed scores that
``model.generate(output_scores=True)`` reports.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specserve.errors import InvalidArgument, InvalidDistribution
from specserve.params import SamplingParams
from specserve.sampling import (
    check_distribution,
    logits_to_probs,
    process_logits,
    sample_from,
    sample_rows,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 48

TEMPERATURES = (0.0, 0.5, 1.0, 1.7)
TOP_KS = (0, 1, 3, 60)  # 60 > VOCAB: HF clips to the vocabulary
TOP_PS = (1.0, 0.9, 0.3)
MIN_PS = (0.0, 0.2)
PENALTIES = (1.0, 1.3, 0.7)


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    # Wider weights than the default init: logits spread out, so top-p / min-p actually cut.
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.generation_config.eos_token_id = None  # never stop early: every step is compared
    return model


def _hf_config(params: SamplingParams) -> GenerationConfig:
    """The ``generate()`` settings that ``params`` stands for (top_k passed explicitly: HF's default is 50)."""
    if params.greedy:
        return GenerationConfig(do_sample=False, repetition_penalty=params.repetition_penalty)
    return GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
    )


def _hf_process(model, params: SamplingParams, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    processors = model._get_logits_processor(
        generation_config=_hf_config(params),
        input_ids_seq_length=input_ids.shape[1],
        device="cpu",
        model_kwargs={"attention_mask": torch.ones_like(input_ids)} if input_ids.numel() else {},
    )
    return processors(input_ids, logits.to(torch.float32).clone())


def _awkward_logits(generator: torch.Generator, rows: int) -> torch.Tensor:
    """[rows, VOCAB]: half the rows integer-valued (many exact ties), -inf entries, and one huge spread."""
    logits = torch.randn(rows, VOCAB, generator=generator) * 3.0
    ties = torch.randint(-3, 4, (rows // 2, VOCAB), generator=generator).to(torch.float32)
    logits[: rows // 2] = ties
    logits[torch.rand(rows, VOCAB, generator=generator) < 0.15] = float("-inf")
    logits[:, 0] = torch.where(logits[:, 0].isinf(), torch.zeros(rows), logits[:, 0])  # one finite per row
    logits[-1] = torch.linspace(-80.0, 80.0, VOCAB)
    return logits


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_process_logits_equals_hf_processors_for_every_setting(tiny_llama, temperature):
    """Every combination of the settings, on logits with ties and -inf, equals HF's processors bit for bit."""
    generator = torch.Generator().manual_seed(int(temperature * 10))
    rows, context_len = 8, 6
    logits = _awkward_logits(generator, rows)
    context = torch.randint(0, VOCAB, (rows, context_len), generator=generator)
    checked = 0
    for top_k, top_p, min_p, penalty in itertools.product(TOP_KS, TOP_PS, MIN_PS, PENALTIES):
        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=penalty
        )
        ours = process_logits(logits, params, context)
        hf = _hf_process(tiny_llama, params, context, logits)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, hf, rtol=0.0, atol=0.0, msg=f"{params}")
        # The setting really did something (or is a no-op by definition): guards against vacuous equality.
        if not params.greedy and (top_k == 1 or top_p == 0.3):
            assert bool((ours.isinf() & ~logits.isinf()).any())
        checked += 1
    assert checked == len(TOP_KS) * len(TOP_PS) * len(MIN_PS) * len(PENALTIES)


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")
def test_ragged_context_penalises_each_row_by_its_own_context(tiny_llama):
    """Rows with contexts of different lengths (including empty) equal HF applied row by row."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=generator) * 2
    contexts = [[1, 2, 2, 5], [], [7], [0, 47, 47, 3, 3, 3, 9]]
    params = SamplingParams(temperature=0.8, repetition_penalty=1.5)
    ours = process_logits(logits, params, contexts)
    for row, seq in enumerate(contexts):
        ids = torch.tensor([seq], dtype=torch.int64).reshape(1, len(seq))
        hf = _hf_process(tiny_llama, params, ids, logits[row : row + 1])
        torch.testing.assert_close(ours[row : row + 1], hf, rtol=0.0, atol=0.0)
    # The empty context is not penalised; the others are.
    plain = process_logits(logits, SamplingParams(temperature=0.8), None)
    torch.testing.assert_close(ours[1], plain[1], rtol=0.0, atol=0.0)
    assert not torch.equal(ours[0], plain[0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=0.8),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0),
    ],
    ids=["all", "top_p", "min_p+penalty", "greedy+penalty", "greedy"],
)
def test_process_logits_equals_generate_scores(tiny_llama, params):
    """Against ``model.generate(output_scores=True)``: the processed scores of every step, and greedy tokens."""
    torch.manual_seed(5)
    prompt = torch.randint(0, VOCAB, (3, 5))
    kwargs = {"do_sample": True, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p}
    if params.greedy:
        kwargs = {"do_sample": False}
    else:
        kwargs["temperature"] = params.temperature
    out = tiny_llama.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=5,
        repetition_penalty=params.repetition_penalty,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )
    assert len(out.scores) == 5
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        context = out.sequences[:, : prompt.shape[1] + step]
        torch.testing.assert_close(process_logits(raw, params, context), scores, rtol=0.0, atol=0.0)
        if params.greedy:
            probs = logits_to_probs(raw, params, context)
            assert probs.argmax(dim=-1).tolist() == out.sequences[:, prompt.shape[1] + step].tolist()


def test_logits_to_probs_sampling_is_float64_softmax_of_processed():
    generator = torch.Generator().manual_seed(11)
    logits = _awkward_logits(generator, 6)
    params = SamplingParams(temperature=0.9, top_k=7, top_p=0.95)
    probs = logits_to_probs(logits, params, None)
    processed = process_logits(logits, params, None)
    assert probs.dtype == torch.float64
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(probs == 0, processed.isinf())  # removed tokens get exactly 0, kept ones > 0
    torch.testing.assert_close(probs, torch.softmax(processed, -1).double(), rtol=0, atol=1e-6)


def test_greedy_probs_are_one_hot_at_lowest_tied_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0], [float("-inf"), 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0), None)
    expected = torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    assert torch.equal(probs, expected)


def test_greedy_applies_the_repetition_penalty_only():
    logits = torch.tensor([[2.0, 1.9, -5.0]])
    context = [[0]]  # token 0 is penalised: 2.0 / 1.5 = 1.33 < 1.9
    greedy = logits_to_probs(logits, SamplingParams(temperature=0.0, repetition_penalty=1.5), context)
    assert greedy.argmax().item() == 1
    # top_k / top_p / min_p are ignored when greedy (HF do_sample=False).
    truncated = SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, repetition_penalty=1.5)
    plain = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert torch.equal(process_logits(logits, truncated, context), process_logits(logits, plain, context))


def test_process_logits_rejects_bad_context():
    logits = torch.zeros(2, 5)
    params = SamplingParams(repetition_penalty=1.2)
    with pytest.raises(InvalidArgument):
        process_logits(logits, params, None)
    with pytest.raises(InvalidArgument):
        process_logits(logits, params, [[1]])  # one context for two rows
    with pytest.raises(InvalidArgument):
        process_logits(logits, params, [[1], [5]])  # id 5 out of a vocabulary of 5
    with pytest.raises(InvalidArgument):
        process_logits(torch.zeros(5), params, [[1]])


def test_sample_from_is_the_inverse_cdf_and_skips_zero_mass_tokens():
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3, 0.0], dtype=torch.float64)
    cases = {0.0: 0, 0.1: 0, 0.199: 0, 0.2: 2, 0.45: 2, 0.699: 2, 0.7: 3, 0.95: 3, 1.0 - 2**-53: 3}
    for u, token in cases.items():
        assert sample_from(probs, u) == token, u
    # A dense grid never lands on a zero-probability token.
    grid = np.linspace(0.0, 1.0, 4001, endpoint=False)
    got = sample_rows(probs.expand(len(grid), -1), grid.tolist())
    assert set(got) == {0, 2, 3}
    # Frequencies on the grid equal the probabilities to the grid's resolution.
    counts = np.bincount(got, minlength=5) / len(grid)
    np.testing.assert_allclose(counts, probs.numpy(), atol=1 / len(grid))


def test_sample_from_near_one_returns_the_last_positive_token_not_a_trailing_zero():
    probs = torch.tensor([0.1, 0.3, 0.6 - 1e-15, 0.0, 0.0], dtype=torch.float64)
    assert sample_from(probs, 1.0 - 2**-53) == 2
    assert sample_from(torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), 1.0 - 2**-53) == 1


def test_sample_rows_matches_sample_from_row_by_row():
    generator = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(64, 300, generator=generator, dtype=torch.float64) * 3, -1)
    us = torch.rand(64, generator=generator, dtype=torch.float64).tolist()
    assert sample_rows(probs, us) == [sample_from(probs[i], us[i]) for i in range(64)]


def test_sample_from_rejects_bad_input():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    for u in (1.0, -0.1, float("nan")):
        with pytest.raises(InvalidArgument):
            sample_from(p, u)
    with pytest.raises(InvalidDistribution):
        sample_from(torch.zeros(3, dtype=torch.float64), 0.5)
    with pytest.raises(InvalidDistribution):
        sample_from(torch.tensor([0.5, float("nan")], dtype=torch.float64), 0.5)


def test_check_distribution_renormalises_within_tolerance():
    probs = torch.tensor([[0.2, 0.3, 0.5004], [1.0, 0.0, 0.0]], dtype=torch.float32)
    out = check_distribution(probs)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.sum(-1), torch.ones(2, dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(out[0], probs[0].double() / probs[0].double().sum(), rtol=0, atol=0)
    assert check_distribution(torch.zeros(0, 5)).shape == (0, 5)


@pytest.mark.parametrize(
    "bad",
    [
        [0.5, float("nan"), 0.5],
        [0.5, float("inf"), 0.5],
        [0.6, -0.1, 0.5],
        [0.5, 0.3, 0.1],  # sums to 0.9
        [0.5, 0.3, 0.2011],  # off by 1.1e-3 > 1e-3
        [0.0, 0.0, 0.0],
    ],
)
def test_check_distribution_raises_on_invalid(bad):
    with pytest.raises(InvalidDistribution):
        check_distribution(torch.tensor([[0.2, 0.3, 0.5], bad], dtype=torch.float64))


def test_check_distribution_is_independent_of_the_batch_shape():
    """The draft renormalises its rows in one call, the target may parse them in another: same bits."""
    generator = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(6, 150_000, generator=generator) * 4, -1).to(torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's own sums differ between these shapes with 2 threads
    try:
        together = check_distribution(probs)
        for i in range(6):
            assert torch.equal(check_distribution(probs[i : i + 1])[0], together[i])
            assert torch.equal(check_distribution(probs[i : i + 1].T.contiguous().T), together[i : i + 1])
    finally:
        torch.set_num_threads(threads)
