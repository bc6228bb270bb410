"""Logits processing equals Hugging Face ``generate()``'s; sampling and distribution checks.

The reference is transformers itself: the processor list that
``GenerationMixin._get_logits_processor`` builds for a real (tiny)
``LlamaForCausalLM`` from a ``GenerationConfig``, and the processed scores that
``model.generate(output_scores=True)`` reports.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specserve.api.errors import InvalidArgument, InvalidDistribution
from specserve.api.params import SamplingParams
from specserve.core.rng import gumbel_noise
from specserve.core.sampling import (
    check_distribution,
    greedy_tokens,
    gumbel_argmax,
    logits_to_probs,
    pick_logprobs,
    process_logits,
    processed_logprobs,
    sample_from,
    sample_rows,
    suppress_tokens,
)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.unit]

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


def test_greedy_tokens_is_argmax_and_refuses_rows_without_a_distribution():
    """One reduction gives the argmax (lowest id on ties, as ``torch.argmax`` and HF greedy) of every healthy
    row, however many rows the call holds, and names the first row holding NaN or +inf or removing every
    token."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, VOCAB, generator=gen)
    logits[2, 3] = logits[2, 7] = logits[2].max() + 1  # a tie: the lower id wins
    logits[4, :10] = -float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert int(greedy_tokens(logits)[2]) == 3
    for b in range(9):  # a row's token does not depend on the rows beside it
        assert int(greedy_tokens(logits[b : b + 1])[0]) == int(logits[b].argmax())
    assert greedy_tokens(torch.empty(0, VOCAB)).shape == (0,)
    for poison in (float("nan"), float("inf"), None):
        bad = logits.clone()
        if poison is None:
            bad[5] = -float("inf")
        else:
            bad[5, 11] = poison
        bad[7, 0] = float("nan")
        with pytest.raises(InvalidDistribution) as info:
            greedy_tokens(bad)
        assert "row 5" in info.value.message


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
        [1.2, 0.0, -0.2],  # sums to 1, one entry negative
        [0.5, float("-inf"), 0.5],
        [float("inf"), float("-inf"), 1.0],  # the infinities' sum is NaN
    ],
)
def test_check_distribution_raises_on_invalid(bad):
    with pytest.raises(InvalidDistribution):
        check_distribution(torch.tensor([[0.2, 0.3, 0.5], bad], dtype=torch.float64))


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ([0.5, float("nan"), 0.5], "NaN or inf"),
        ([float("inf"), float("-inf"), 1.0], "NaN or inf"),
        ([1.2, 0.0, -0.2], "negative entries (min -0.2)"),
        ([0.5, float("-inf"), 1.5], "NaN or inf"),
    ],
)
def test_check_distribution_says_what_is_wrong(bad, says):
    with pytest.raises(InvalidDistribution, match=re.escape(says)):
        check_distribution(torch.tensor([bad], dtype=torch.float64))


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


# --------------------------------------------------------------------------- Gumbel-max


def test_gumbel_argmax_exact_cases():
    p = torch.tensor([[0.1, 0.6, 0.0, 0.3], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    zero = torch.zeros_like(p)
    assert gumbel_argmax(p, zero).tolist() == [1, 0]  # no noise: the argmax (first of a tie)
    huge = torch.tensor([[0.0, 0.0, 1e6, 0.0], [0.0, 0.0, 0.0, 0.5]], dtype=torch.float64)
    assert gumbel_argmax(p, huge).tolist() == [1, 3]  # a removed token never wins, whatever its noise
    nudge = torch.tensor([[0.0, 0.0, 0.0, math.log(2.0) + 1e-9]] * 2, dtype=torch.float64)
    assert gumbel_argmax(p, nudge).tolist() == [3, 3]  # log 0.3 + log 2 + eps > log 0.6
    batched = gumbel_argmax(p.expand(3, 2, 4), huge.expand(3, 2, 4))  # [..., vocab] -> [...]
    assert batched.shape == (3, 2) and batched.tolist() == [[1, 3]] * 3


def test_gumbel_argmax_rejects_bad_input():
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    with pytest.raises(InvalidArgument):
        gumbel_argmax(p, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(InvalidDistribution):
        gumbel_argmax(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(InvalidDistribution):
        gumbel_argmax(torch.tensor([float("nan"), 0.5]), torch.zeros(2, dtype=torch.float64))


GUMBEL_P = (0.4, 0.25, 0.15, 0.1, 0.1, 0.0)
GUMBEL_N = 20_000
ALPHA_GUMBEL = 0.001


def _gumbel_counts(scale: float) -> np.ndarray:
    p = torch.tensor(GUMBEL_P, dtype=torch.float64).expand(GUMBEL_N, -1)  # [N, 6]
    noise = gumbel_noise([2024] * GUMBEL_N, list(range(GUMBEL_N)), len(GUMBEL_P))  # [N, 6]
    return np.bincount(gumbel_argmax(p, scale * noise).numpy(), minlength=len(GUMBEL_P))


def test_gumbel_argmax_with_the_noise_samples_the_distribution():
    """Chi-square at alpha = 0.001 over N = 20,000 positions of one seed (df 4, the zero-probability
    token excluded and never drawn). A wrongly scaled noise (0.8 G: sampling p^1.25, a temperature
    error) has per-sample noncentrality 0.0170, lambda = 340 at this N: the same test rejects it with
    probability > 1 - 1e-12, and does here."""
    expected = GUMBEL_N * np.array(GUMBEL_P[:-1])
    counts = _gumbel_counts(1.0)
    assert counts[-1] == 0
    assert stats.chisquare(counts[:-1], expected).pvalue >= ALPHA_GUMBEL
    assert stats.chisquare(_gumbel_counts(0.8)[:-1], expected).pvalue < ALPHA_GUMBEL


# --------------------------------------------------------------------------- no NaN, ever


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": 1e-40}, "temperature=1e-40 is too small"),
        ({"temperature": 0.009}, "at least 0.01"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty must be in [0.01, 100]"),
        ({"repetition_penalty": 1e6}, "repetition_penalty must be in [0.01, 100]"),
    ],
)
def test_settings_that_would_overflow_the_logits_are_refused_naming_the_parameter(kwargs, needle):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(**kwargs)
    assert needle in info.value.message


def test_the_most_extreme_accepted_settings_keep_every_row_a_distribution():
    """At the bounds (temperature 0.01 with penalty 0.01 or 100) on large logits the rows stay finite and sum
    to one: the bounds are where they are for a reason, and a setting just past them is refused above."""
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 50.0  # [4, vocab]
    context = [list(range(VOCAB))] * 4  # every token penalised
    for penalty in (0.01, 100.0):
        params = SamplingParams(temperature=0.01, repetition_penalty=penalty, seed=1)
        probs = logits_to_probs(logits, params, context)  # [4, vocab]
        assert bool(torch.isfinite(probs).all())
        torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_of_non_finite_logits_has_no_distribution(poison, temperature):
    """NaN or +inf logits (greedy argmax included, where a NaN would silently win) raise InvalidDistribution
    naming the row; a row where every token is removed raises too; healthy rows pass."""
    logits = torch.randn(3, VOCAB)  # [3, vocab]
    params = SamplingParams(temperature=temperature)
    logits_to_probs(logits, params, None)  # control: healthy rows
    logits[1, 5] = poison
    with pytest.raises(InvalidDistribution) as info:
        logits_to_probs(logits, params, None)
    assert "row 1" in info.value.message
    removed = torch.full((2, VOCAB), -float("inf"))
    with pytest.raises(InvalidDistribution):
        logits_to_probs(removed, params, None)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0),
    ],
    ids=["sampled", "greedy+penalty", "greedy"],
)
def test_processed_logprobs_are_the_log_softmax_of_generates_scores(tiny_llama, params):
    """Against ``model.generate(output_scores=True)``: the log-softmax of each step's processed scores (greedy:
    the repetition penalty, at temperature 1); for sampling, the log of what ``logits_to_probs`` samples from."""
    torch.manual_seed(6)
    prompt = torch.randint(0, VOCAB, (2, 5))
    kwargs = {"do_sample": False} if params.greedy else {
        "do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p
    }  # fmt: skip
    out = tiny_llama.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=4,
        repetition_penalty=params.repetition_penalty,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        context = out.sequences[:, : prompt.shape[1] + step]
        got = processed_logprobs(raw, params, context)
        assert got.dtype == torch.float64
        want = torch.log_softmax(scores.double(), dim=-1)
        assert torch.equal(got.isinf(), want.isinf())
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-12)
        if params.greedy:
            assert bool(got.isfinite().all()), "greedy removes no token: every logprob is finite"
        else:
            probs = logits_to_probs(raw, params, context)
            torch.testing.assert_close(got.exp(), probs, rtol=0, atol=1e-12)


def test_pick_logprobs_lists_the_emitted_token_and_the_most_likely_ones():
    logprobs = torch.log(
        torch.tensor([[0.1, 0.4, 0.0, 0.2, 0.3], [0.25, 0.25, 0.5, 0.0, 0.0]], dtype=torch.float64)
    )  # [2, 5]
    first, second = pick_logprobs(logprobs, [0, 1], 3)
    assert first.token_id == 0 and first.logprob == pytest.approx(math.log(0.1))
    assert [t.token_id for t in first.top_logprobs] == [1, 4, 3]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx([math.log(0.4), math.log(0.3), math.log(0.2)])
    assert second.token_id == 1 and [t.token_id for t in second.top_logprobs] == [2, 0, 1], "ties: lower id first"
    (only,) = pick_logprobs(logprobs[1:], [2], 5)
    assert [t.token_id for t in only.top_logprobs] == [2, 0, 1], "probability-0 tokens are never listed"
    assert [e.top_logprobs for e in pick_logprobs(logprobs, [0, 2], 0)] == [(), ()]
    assert pick_logprobs(logprobs[:0], [], 3) == ()
    with pytest.raises(InvalidArgument):
        pick_logprobs(logprobs, [0], 3)


def test_suppress_tokens_masks_the_first_rows_only_and_copies():
    logits = torch.tensor([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0], [3.0, 1.0, 2.0]])  # [3, 3]
    out = suppress_tokens(logits, frozenset({0, 7}), 2)  # 7: outside the vocabulary, skipped
    assert out[:2, 0].tolist() == [float("-inf")] * 2 and out[2].tolist() == [3.0, 1.0, 2.0]
    assert logits[0, 0] == 3.0  # the input is untouched
    assert greedy_tokens(out).tolist() == [2, 2, 0]
    assert suppress_tokens(logits, frozenset({0}), 0) is logits and suppress_tokens(logits, (), 3) is logits
    probs = logits_to_probs(out, SamplingParams(temperature=0.7, top_k=2), None)
    assert probs[0, 0] == 0.0 and probs[2, 0] > 0.0  # the masked row is then processed as any other
