"""Counter-based randomness: one uniform per (seed, position, purpose).

Every random decision of a session is a pure function of the session's seed,
the absolute position in the token sequence of the token being decided, and
what the number is for (:class:`Purpose`). No generator state is carried
between calls, so:

* a session's output never depends on which other sessions shared its batch,
  nor on which replica served which round;
* a retried round draws exactly the same numbers;
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
"""

from __future__ import annotations

import enum
import hashlib
import struct

from specserve.errors import InvalidArgument

_PERSON = b"specserve.rng.1"
_PACK = struct.Struct("<QQB")
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


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """The uniform in ``[0, 1)`` for ``(seed, position, purpose)``; a pure function.

    ``seed`` is the session seed in ``[0, 2**64)``; ``position`` is the absolute
    index (``>= 0``) in the session's token sequence of the token being decided.
    Raises :class:`~specserve.errors.InvalidArgument` outside those ranges.
    """
    if not (0 <= seed < _U64 and 0 <= position < _U64):
        raise InvalidArgument(f"seed and position must be in [0, 2**64), got seed={seed} position={position}")
    digest = hashlib.blake2b(
        _PACK.pack(seed, position, int(Purpose(purpose))), digest_size=8, person=_PERSON
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) * _SCALE
