"""Counter-based randomness: purity, the documented construction, uniformity and independence;
the Gumbel noise of the coupled mode likewise (construction pinned, per-row purity, distribution,
independence, the same bits on every device)."""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.api.errors import InvalidArgument
from specserve.core.rng import Purpose, gumbel_noise, gumbel_uniforms, ranked_uniform, uniform

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.unit]

ALPHA = 0.001


def _reference(seed: int, position: int, purpose: int) -> float:
    """The construction stated in the module docstring, written out independently."""
    message = struct.pack("<QQB", seed, position, purpose)
    digest = hashlib.blake2b(message, digest_size=8, person=b"specserve.rng.1").digest()
    return (int.from_bytes(digest, "little") >> 11) / 2**53


def test_uniform_follows_the_documented_construction():
    """Replicas on other versions must replay the same numbers: the construction is a contract."""
    for seed, position, purpose in [(0, 0, Purpose.DRAFT), (2**64 - 1, 12345, Purpose.ACCEPT), (7, 2**40, 3)]:
        assert uniform(seed, position, purpose) == _reference(seed, position, int(purpose))


def test_uniform_is_pure_and_in_range():
    values = [uniform(s, p, k) for s in range(20) for p in range(20) for k in Purpose]
    assert values == [uniform(s, p, k) for s in range(20) for p in range(20) for k in Purpose]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)  # 1200 distinct inputs, no collisions


def test_purposes_seeds_and_positions_give_different_numbers():
    base = uniform(5, 9, Purpose.ACCEPT)
    assert base != uniform(5, 9, Purpose.DRAFT)
    assert base != uniform(5, 9, Purpose.RESAMPLE)
    assert base != uniform(6, 9, Purpose.ACCEPT)
    assert base != uniform(5, 10, Purpose.ACCEPT)


def test_uniform_is_uniform_and_purposes_are_independent():
    """Kolmogorov-Smirnov on 20,000 draws (seeds and positions varied) and a chi-square on a 10x10 grid
    of (ACCEPT, RESAMPLE) pairs at the same (seed, position), each at significance alpha = 0.001.

    A generator that returned, say, ``position / 2**k`` or reused one stream for two purposes fails.
    """
    n = 20_000
    keys = [(seed * 7919 + 13, seed % 97) for seed in range(n)]
    accept = np.array([uniform(s, p, Purpose.ACCEPT) for s, p in keys])
    resample = np.array([uniform(s, p, Purpose.RESAMPLE) for s, p in keys])
    assert stats.kstest(accept, "uniform").pvalue >= ALPHA
    assert stats.kstest(resample, "uniform").pvalue >= ALPHA
    cells = np.bincount((accept * 10).astype(int) * 10 + (resample * 10).astype(int), minlength=100)
    assert stats.chisquare(cells).pvalue >= ALPHA
    # The same check rejects dependent streams (its power is not vacuous).
    dependent = np.bincount(
        (accept * 10).astype(int) * 10 + ((accept * 7) % 1 * 10).astype(int), minlength=100
    )
    assert stats.chisquare(dependent).pvalue < ALPHA


@pytest.mark.parametrize("seed, position", [(-1, 0), (2**64, 0), (0, -1), (0, 2**64)])
def test_uniform_rejects_out_of_range_arguments(seed, position):
    with pytest.raises(InvalidArgument):
        uniform(seed, position, Purpose.DRAFT)


# --------------------------------------------------------------------------- ranked uniforms


def _ranked_reference(seed: int, position: int, purpose: int, rank: int) -> float:
    """The ranked construction stated in the module docstring, written out independently."""
    if rank == 0:
        return _reference(seed, position, purpose)
    message = struct.pack("<QQBQ", seed, position, purpose, rank)
    digest = hashlib.blake2b(message, digest_size=8, person=b"specserve.rng.1").digest()
    return (int.from_bytes(digest, "little") >> 11) / 2**53


def test_ranked_uniform_follows_the_documented_construction():
    """Rank 0 is the unranked uniform (a chain draws what it always drew); ranks >= 1 the 25-byte message."""
    cases = [(0, 0, Purpose.ACCEPT, 0), (0, 0, Purpose.ACCEPT, 1), (2**64 - 1, 77, Purpose.ACCEPT, 3)]
    cases += [(9, 2**40, Purpose.RESAMPLE, 2**64 - 1), (123, 4, Purpose.DRAFT, 7)]
    for seed, position, purpose, rank in cases:
        assert ranked_uniform(seed, position, purpose, rank) == _ranked_reference(seed, position, purpose, rank)
    assert ranked_uniform(5, 9, Purpose.ACCEPT, 0) == uniform(5, 9, Purpose.ACCEPT)
    assert ranked_uniform(5, 9, Purpose.ACCEPT, 1) != uniform(5, 9, Purpose.ACCEPT)


def test_ranks_are_uniform_and_independent():
    """KS of rank 1 and a chi-square on a 10x10 grid of (rank 0, rank 1) pairs at the same key, alpha =
    0.001 over 20,000 keys; ranks 0..7 at one key never collide."""
    n = 20_000
    keys = [(seed * 7919 + 13, seed % 97) for seed in range(n)]
    first = np.array([ranked_uniform(s, p, Purpose.ACCEPT, 0) for s, p in keys])
    second = np.array([ranked_uniform(s, p, Purpose.ACCEPT, 1) for s, p in keys])
    assert stats.kstest(second, "uniform").pvalue >= ALPHA
    cells = np.bincount((first * 10).astype(int) * 10 + (second * 10).astype(int), minlength=100)
    assert stats.chisquare(cells).pvalue >= ALPHA
    values = [ranked_uniform(3, 4, Purpose.ACCEPT, r) for r in range(8)]
    assert len(set(values)) == 8


@pytest.mark.parametrize("seed, position, rank", [(-1, 0, 1), (2**64, 0, 1), (0, -1, 1), (0, 0, -1), (0, 0, 2**64)])
def test_ranked_uniform_rejects_out_of_range_arguments(seed, position, rank):
    with pytest.raises(InvalidArgument):
        ranked_uniform(seed, position, Purpose.ACCEPT, rank)


# --------------------------------------------------------------------------- Gumbel noise

_U64 = 2**64


def _gumbel_uniform_reference(seed: int, position: int, token: int) -> float:
    """The construction stated in the module docstring, in Python integers (no torch)."""
    message = struct.pack("<QQB", seed, position, 4)  # purpose GUMBEL
    key = int.from_bytes(
        hashlib.blake2b(message, digest_size=8, person=b"specserve.rng.1").digest(), "little"
    )
    z = (key + (token + 1) * 0x9E3779B97F4A7C15) % _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _U64
    z = z ^ (z >> 31)
    return ((z >> 11) + 0.5) / 2**53


#: Pinned values (seed, position) -> noise of tokens 0..3: a change of the construction changes
#: every seeded coupled output, so it must fail a test even if the reference above changed with it.
PINNED_NOISE = {
    (0, 0): (-0.4485443508751161, -0.01353543443578041, -1.1090773990557508, 1.9445845029738007),
    (7, 12): (0.9145135020040022, 2.151037392440233, -0.084716477298519, -0.2859043680778095),
    (2**64 - 1, 2**40): (-0.15748931162125568, -1.4491945841930547, -0.6644152371476679, 0.757176697359689),
}


def test_gumbel_uniforms_follow_the_documented_construction():
    """Bit for bit, including the wrap-around of the int64 arithmetic and seeds above 2**63."""
    cases = [(0, 0), (7, 12), (2**63 + 5, 3), (2**64 - 1, 2**40), (123456789, 2**63)]
    tokens = [0, 1, 2, 1000, 49151, 2**20 - 1]
    got = gumbel_uniforms([s for s, _ in cases], [p for _, p in cases], 2**20)  # [cases, 2**20]
    for row, (seed, position) in enumerate(cases):
        for token in tokens:
            assert float(got[row, token]) == _gumbel_uniform_reference(seed, position, token)
    assert bool(((got > 0) & (got < 1)).all())


def test_gumbel_noise_is_pinned():
    for (seed, position), expected in PINNED_NOISE.items():
        got = gumbel_noise([seed], [position], 4)[0].tolist()
        assert got == pytest.approx(expected, rel=1e-15, abs=0)
        reference = [-math.log(-math.log(_gumbel_uniform_reference(seed, position, t))) for t in range(4)]
        assert got == pytest.approx(reference, rel=1e-15, abs=0)


def test_gumbel_noise_rows_are_pure():
    """A row is a function of its (seed, position) alone: not of the other rows, their number,
    the vocabulary size (a longer row extends a shorter one) or the CPU block the row falls in."""
    seeds, positions = [3, 9, 3, 2**64 - 2], [40, 40, 41, 0]
    together = gumbel_noise(seeds, positions, 1000)  # [4, 1000], several rows per CPU block
    wide = gumbel_noise(seeds, positions, 70_000)  # [4, 70000], one row per CPU block
    for r, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        alone = gumbel_noise([seed], [position], 1000)[0]
        assert torch.equal(together[r], alone)
        assert torch.equal(wide[r, :1000], alone)
    assert not torch.equal(together[0], together[1])  # another seed
    assert not torch.equal(together[0], together[2])  # another position
    many = gumbel_noise([5] * 300, list(range(300)), 1000)  # 300 rows in CPU blocks of 65 rows
    for r in (0, 64, 65, 299):
        assert torch.equal(many[r], gumbel_noise([5], [r], 1000)[0])
    assert gumbel_noise([], [], 5).shape == (0, 5)


GUMBEL_N_POSITIONS = 50
GUMBEL_VOCAB = 1000


def _gumbel_cdf(x):
    return np.exp(-np.exp(-x))


def test_gumbel_noise_is_gumbel_and_independent():
    """50,000 draws (50 positions x 1,000 tokens) at significance alpha = 0.001 each:

    * Kolmogorov-Smirnov against the Gumbel(0, 1) CDF; the same test rejects a noise shifted by
      0.05 (D ~ 0.018 against a critical 0.0087 at this n), so it is not vacuous;
    * chi-square on a 10 x 10 grid of the CDF deciles of neighbouring tokens (t, t + 1) at one
      position, and of one token at neighbouring positions (p, p + 1): independence; the same grid
      rejects a dependent pairing (t with a function of t's own value).
    """
    noise = gumbel_noise([11] * GUMBEL_N_POSITIONS, list(range(GUMBEL_N_POSITIONS)), GUMBEL_VOCAB).numpy()
    flat = noise.reshape(-1)
    assert stats.kstest(flat, _gumbel_cdf).pvalue >= ALPHA
    assert stats.kstest(flat + 0.05, _gumbel_cdf).pvalue < ALPHA
    deciles = np.minimum((_gumbel_cdf(noise) * 10).astype(int), 9)  # [positions, vocab]

    def grid_p(a, b):
        return stats.chisquare(np.bincount(a.reshape(-1) * 10 + b.reshape(-1), minlength=100)).pvalue

    assert grid_p(deciles[:, :-1], deciles[:, 1:]) >= ALPHA  # neighbouring tokens
    assert grid_p(deciles[:-1, :], deciles[1:, :]) >= ALPHA  # neighbouring positions
    dependent = np.minimum((_gumbel_cdf(noise) * 7 % 1 * 10).astype(int), 9)
    assert grid_p(deciles, dependent) < ALPHA


def test_gumbel_noise_differs_from_the_uniform_streams():
    """The GUMBEL key is its own purpose: no row starts with a number another purpose draws."""
    row = gumbel_uniforms([5], [9], 4)[0].tolist()
    others = {uniform(5, 9, purpose) for purpose in (Purpose.DRAFT, Purpose.ACCEPT, Purpose.RESAMPLE)}
    assert not others & set(row)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gumbel_noise_is_the_same_on_cuda():
    """Integer bits equal on CUDA and CPU; the float64 log of the two backends within 1e-15 relative."""
    seeds, positions = [0, 7, 2**64 - 1], [0, 12, 2**40]
    cpu_u = gumbel_uniforms(seeds, positions, 49_152)
    cuda_u = gumbel_uniforms(seeds, positions, 49_152, device="cuda")
    assert torch.equal(cpu_u, cuda_u.cpu())
    torch.testing.assert_close(
        gumbel_noise(seeds, positions, 49_152, device="cuda").cpu(),
        gumbel_noise(seeds, positions, 49_152),
        rtol=1e-15,
        atol=1e-15,
    )


@pytest.mark.parametrize(
    "seeds, positions, vocab",
    [([-1], [0], 4), ([2**64], [0], 4), ([0], [-1], 4), ([0], [2**64], 4), ([0, 1], [0], 4), ([0], [0], 0)],
)
def test_gumbel_noise_rejects_bad_arguments(seeds, positions, vocab):
    with pytest.raises(InvalidArgument):
        gumbel_noise(seeds, positions, vocab)
