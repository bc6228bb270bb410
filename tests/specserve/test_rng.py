"""Counter-based randomness: purity, the documented construction, uniformity and independence."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from scipy import stats

from specserve.errors import InvalidArgument
from specserve.rng import Purpose, uniform

pytestmark = pytest.mark.usefixtures("one_torch_thread")

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
