"""The target's features on the wire: rows of committed positions, float16, relayed undecoded.

A :class:`FeatureBlock` holds the target's features (``specserve.engine.feature_head``)
of committed positions ``[start, start + count)``: ``count`` rows of ``hidden``
little-endian float16 values (``common_pb2.Features``). The target encodes them
(:func:`encode`), the coordinator keeps and slices blocks as bytes
(:meth:`FeatureBlock.slice`, :meth:`FeatureBlock.join`) without decoding them,
and the draft decodes them (:func:`decode`). docs/design.md, "The feature head".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.api.errors import InvalidArgument
from specserve.v1 import common_pb2

if TYPE_CHECKING:
    import torch

#: Bytes per value on the wire (float16).
VALUE_BYTES = 2


@dataclass(frozen=True)
class FeatureBlock:
    """Features of committed positions ``[start, stop)``, ``hidden`` float16 values per row, as bytes."""

    start: int
    hidden: int
    data: bytes

    def __post_init__(self) -> None:
        if self.start < 0 or self.hidden < 1:
            raise InvalidArgument(f"features: start {self.start} and hidden size {self.hidden} must be >= 0 / >= 1")
        if len(self.data) % (self.hidden * VALUE_BYTES):
            raise InvalidArgument(
                f"features: {len(self.data)} bytes is not a whole number of rows of {self.hidden} float16 values"
            )

    @property
    def count(self) -> int:
        return len(self.data) // (self.hidden * VALUE_BYTES)

    @property
    def stop(self) -> int:
        return self.start + self.count

    def slice(self, start: int, stop: int) -> FeatureBlock:
        """The rows of positions ``[start, stop)`` (clipped to this block)."""
        start, stop = max(start, self.start), min(stop, self.stop)
        if stop <= start:
            return FeatureBlock(start=max(start, self.start), hidden=self.hidden, data=b"")
        row = self.hidden * VALUE_BYTES
        return FeatureBlock(
            start=start, hidden=self.hidden, data=self.data[(start - self.start) * row : (stop - self.start) * row]
        )

    def join(self, later: FeatureBlock) -> FeatureBlock:
        """This block followed by ``later``, which must start at or before this block's end (overlap is
        taken from ``later``)."""
        if later.hidden != self.hidden:
            raise InvalidArgument(f"features: hidden size {later.hidden} after {self.hidden}")
        if later.start > self.stop:
            raise InvalidArgument(f"features: a gap between positions {self.stop} and {later.start}")
        head = self.slice(self.start, later.start)
        return FeatureBlock(start=head.start if head.count else later.start, hidden=self.hidden,
                            data=head.data + later.data)

    def to_pb(self) -> common_pb2.Features:
        return common_pb2.Features(start_position=self.start, hidden_size=self.hidden, float16_le=self.data)

    @classmethod
    def from_pb(cls, pb: common_pb2.Features) -> FeatureBlock:
        return cls(start=pb.start_position, hidden=pb.hidden_size, data=bytes(pb.float16_le))


def encode(rows: torch.Tensor, start: int) -> FeatureBlock:
    """``rows`` ``[count, hidden]`` (any float tensor) as a block starting at position ``start``."""
    import numpy as np

    values = rows.detach().to("cpu").float().numpy().astype("<f2")
    return FeatureBlock(start=start, hidden=int(values.shape[1]), data=np.ascontiguousarray(values).tobytes())


def decode(block: FeatureBlock) -> torch.Tensor:
    """The block's rows as a ``[count, hidden]`` float32 tensor."""
    import numpy as np
    import torch

    values = np.frombuffer(block.data, dtype="<f2").reshape(block.count, block.hidden)
    return torch.from_numpy(values.astype(np.float32))
