"""Counter-based randomness: one uniform per (seed, position, purpose), and Gumbel noise per (seed, position).

Every random decision of a session is a pure function of the session's seed,
the absolute position in the token sequence of the token being decided, and
what the number is for (:class:`Purpose`). No generator state is carried
between calls, so:

* the numbers a session draws never depend on which other sessions shared its
  batch, nor on which replica served which round;
* a retried round draws exactly the same numbers;
* what the numbers decide may still depend on the draft: with rejection
  sampling the accepted tokens do (the same seed gives the same text only
  under the same gamma schedule and proposer); in the coupled mode the noise
  alone decides the target's tokens (docs/design.md, "Two sampling modes");
* the draft, the acceptance test and the target's resampling at one position
  draw independent numbers (different purposes).

Construction (a documented contract: changing it changes every seeded
output)::

    digest = blake2b(pack("<QQB", seed, position, purpose),
                     digest_size=8, person=b"specserve.rng.1")
    uniform = (int.from_bytes(digest, "little") >> 11) * 2**-53     # in [0, 1)

that is, the top 53 bits of a 64-bit keyed hash, the full mantissa of a float64.
BLAKE2b is a cryptographic hash, so the outputs for distinct inputs behave as
independent uniforms; one call costs about a microsecond.

**Ranked uniforms** (:func:`ranked_uniform`): where one position needs several
numbers of one purpose, tried in order (the acceptance tests of a draft tree's
siblings, :mod:`specserve.core.tree_verification`), the ``r``-th is
:func:`uniform` itself for ``r = 0`` and, for ``r >= 1``, also a documented
contract::

    digest = blake2b(pack("<QQBQ", seed, position, purpose, r),
                     digest_size=8, person=b"specserve.rng.1")
    uniform = (int.from_bytes(digest, "little") >> 11) * 2**-53

The message is 25 bytes where :func:`uniform`'s is 17, so no ranked input is
ever an unranked one, and every rank draws an independent stream.

**Gumbel noise** (:func:`gumbel_noise`, the shared randomness of the coupled
sampling mode, docs/design.md "Two sampling modes"): one Gumbel(0, 1) number
per (seed, position, token id), over the whole vocabulary. Also a documented
contract::

    key   = int.from_bytes(blake2b(pack("<QQB", seed, position, GUMBEL),
                                   digest_size=8, person=b"specserve.rng.1"), "little")
    z     = (key + (t + 1) * 0x9E3779B97F4A7C15) mod 2**64       # t = token id
    z     = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2**64
    z     = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2**64
    z     =   z ^ (z >> 31)
    u     = ((z >> 11) + 0.5) * 2**-53                            # in (0, 1), never 0 or 1
    noise = -log(-log(u))                                         # float64

that is, the per-position key is the same keyed BLAKE2b as :func:`uniform`
(purpose ``GUMBEL``), and token ``t`` takes output ``t + 1`` of the SplitMix64
generator started at that key (Steele, Lea and Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014). The integer part is computed
vectorised over the vocabulary with int64 tensor operations (wrapping
multiplication, logical shifts by masking), so the bits are the same on the CPU
and on CUDA and in every process; torch's own generators are not (they differ
between devices and carry state). The float64 ``log`` of each backend is
accurate to about one unit in the last place, so the noise agrees across
backends to about 1e-16 relative; see docs/design.md, "Numerics".
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.api.errors import InvalidArgument

if TYPE_CHECKING:  # torch is imported when noise is drawn: the uniforms need no torch
    import torch

_PERSON = b"specserve.rng.1"
_PACK = struct.Struct("<QQB")
_PACK_RANKED = struct.Struct("<QQBQ")
_SCALE = 2.0**-53
_U64 = 2**64


class Purpose(enum.IntEnum):
    """What a uniform decides; each purpose draws an independent stream."""

    #: The draft sampling the token at this position.
    DRAFT = 1
    #: The acceptance test of the draft token at this position.
    ACCEPT = 2
    #: The target sampling the token at this position: correction, bonus, or a gamma = 0 step.
    RESAMPLE = 3
    #: The key of the Gumbel noise vector at this position (coupled mode, :func:`gumbel_noise`).
    GUMBEL = 4


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """The uniform in ``[0, 1)`` for ``(seed, position, purpose)``; a pure function.

    ``seed`` is the session seed in ``[0, 2**64)``; ``position`` is the absolute
    index (``>= 0``) in the session's token sequence of the token being decided.
    Raises :class:`~specserve.api.errors.InvalidArgument` outside those ranges.
    """
    return (_digest64(seed, position, purpose) >> 11) * _SCALE


def ranked_uniform(seed: int, position: int, purpose: Purpose, rank: int) -> float:
    """The ``rank``-th uniform in ``[0, 1)`` for ``(seed, position, purpose)``; a pure function.

    ``rank = 0`` is :func:`uniform` (so a chain, whose positions need one number
    each, draws what it always drew); ``rank >= 1`` is the ranked construction
    of the module docstring. Raises :class:`~specserve.api.errors.InvalidArgument`
    for a seed, position or rank outside ``[0, 2**64)``.
    """
    if rank == 0:
        return uniform(seed, position, purpose)
    if not (0 <= seed < _U64 and 0 <= position < _U64 and 0 < rank < _U64):
        raise InvalidArgument(
            f"seed, position and rank must be in [0, 2**64), got seed={seed} position={position} rank={rank}"
        )
    digest = hashlib.blake2b(
        _PACK_RANKED.pack(seed, position, int(Purpose(purpose)), rank), digest_size=8, person=_PERSON
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) * _SCALE


def _digest64(seed: int, position: int, purpose: Purpose) -> int:
    """The 64-bit keyed BLAKE2b of ``(seed, position, purpose)``, as an unsigned int."""
    if not (0 <= seed < _U64 and 0 <= position < _U64):
        raise InvalidArgument(f"seed and position must be in [0, 2**64), got seed={seed} position={position}")
    digest = hashlib.blake2b(
        _PACK.pack(seed, position, int(Purpose(purpose))), digest_size=8, person=_PERSON
    ).digest()
    return int.from_bytes(digest, "little")


def _signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return value - _U64 if value >= 2**63 else value


#: SplitMix64's increment and its two multipliers, as int64 bit patterns.
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
#: On the CPU, rows of noise computed at once: about 2**16 elements, so the int64 temporaries
#: stay in cache (faster per row than all rows at once: docs/benchmarks/history.md). Other devices take every row in one pass (a few kernel launches in all).
_CPU_BLOCK_ELEMENTS = 1 << 16


def gumbel_noise(
    seeds: Sequence[int],
    positions: Sequence[int],
    vocab_size: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Gumbel(0, 1) noise over the vocabulary: ``[rows, vocab_size]`` float64 on ``device``.

    Row ``r`` is the noise of ``(seeds[r], positions[r])`` (the construction in the
    module docstring), ``-log(-log(u))`` of :func:`gumbel_uniforms`; entry ``t``
    belongs to token id ``t``. Each row depends on its own seed and position
    alone, never on the other rows, on ``vocab_size`` (a longer row extends a
    shorter one) or on the device.
    """
    return gumbel_uniforms(seeds, positions, vocab_size, device=device).log_().neg_().log_().neg_()


def gumbel_uniforms(
    seeds: Sequence[int],
    positions: Sequence[int],
    vocab_size: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The uniforms behind :func:`gumbel_noise`: ``[rows, vocab_size]`` float64 in ``(0, 1)``.

    Integer arithmetic only, so every backend gives the same bits. Raises
    :class:`~specserve.api.errors.InvalidArgument` for seeds or positions outside
    ``[0, 2**64)``, different lengths, or ``vocab_size < 1``.
    """
    import torch

    if len(seeds) != len(positions):
        raise InvalidArgument(f"{len(seeds)} seeds for {len(positions)} positions")
    if vocab_size < 1:
        raise InvalidArgument(f"vocab_size must be >= 1, got {vocab_size}")
    keys = [_signed(_digest64(int(s), int(p), Purpose.GUMBEL)) for s, p in zip(seeds, positions, strict=True)]
    out = torch.empty((len(keys), vocab_size), dtype=torch.float64, device=device)  # [rows, vocab]
    if not keys:
        return out
    steps = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=out.device).mul_(_GOLDEN)  # [vocab]
    key_rows = torch.tensor(keys, dtype=torch.int64, device=out.device)[:, None]  # [rows, 1]
    block = max(1, _CPU_BLOCK_ELEMENTS // vocab_size) if out.device.type == "cpu" else len(keys)
    for start in range(0, len(keys), block):
        z = key_rows[start : start + block] + steps  # [block, vocab] int64, wraps mod 2**64
        _splitmix64_mix_(z)
        z >>= 11
        z &= (1 << 53) - 1  # the top 53 bits, as a non-negative int64 (exact in float64)
        u = out[start : start + block]  # [block, vocab]
        u.copy_(z)
        u.add_(0.5).mul_(_SCALE)  # in (0, 1): never 0 or 1
    return out


def _splitmix64_mix_(z: torch.Tensor) -> None:
    """SplitMix64's output function on int64 ``z`` (``[...]``), in place; ``>>`` is made logical by masking."""
    import torch

    tmp = torch.empty_like(z)  # [...]
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1
        z ^= tmp
        if multiplier is not None:
            z *= multiplier
