"""A draft's proposal between the proposer and the verifier, and its wire codec for ``q``.

:class:`DraftProposal` is the small dataclass that carries a proposal to the
verifier (the tokens and the exact distributions ``q_i`` they were sampled
from); neither side imports the other (docs/design.md, "Conventions").

The wire form of ``q`` (``common_pb2.DraftDistribution``): a dense row is the
little-endian float32 bytes of the whole vocabulary, a sparse row (a truncated
draft) lists its support. The draft samples from
``check_distribution(probs_f32)`` and ships ``probs_f32``
(:func:`draft_probs_to_pb`); the target rebuilds exactly that float64 tensor,
bit for bit (:func:`draft_probs_from_pb`), so both sides use the identical ``q``
(docs/design.md, "Exactness has preconditions").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.api.errors import InvalidArgument, InvalidDistribution, VocabularyMismatch
from specserve.core.sampling import check_distribution
from specserve.v1 import common_pb2


@dataclass(frozen=True, eq=False)
class DraftProposal:
    """Tokens a proposer drafted and the distributions they were sampled from.

    ``probs`` is ``[gamma, vocab]`` float64, row ``i`` the exact ``q_i`` that
    ``token_ids[i]`` was sampled from; ``None`` means a point mass on each
    token (n-gram proposals, greedy drafts).
    """

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None  # [gamma, vocab] float64

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if any(t < 0 for t in self.token_ids):
            raise InvalidArgument(f"token ids must be >= 0, got {self.token_ids}")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)):
            raise InvalidArgument(
                f"probs must be [gamma={len(self.token_ids)}, vocab], got {tuple(self.probs.shape)}"
            )

    @property
    def gamma(self) -> int:
        return len(self.token_ids)


def dense_from_sparse(
    ids: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """A sparse support ``(ids, probs)`` as a dense ``[vocab]`` float64 row; every other token is 0.

    Checks the ids (distinct, in range) and the lengths; the values are checked
    by :func:`~specserve.core.sampling.check_distribution` afterwards.
    """
    index = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)  # [support]
    values = torch.as_tensor(probs, dtype=torch.float64).reshape(-1)  # [support]
    if index.shape != values.shape:
        raise InvalidArgument(f"sparse support has {index.numel()} ids but {values.numel()} probabilities")
    if index.numel() == 0:
        raise InvalidDistribution("sparse distribution with an empty support")
    if int(index.min()) < 0 or int(index.max()) >= vocab_size:
        raise InvalidArgument(f"sparse token ids must be in [0, {vocab_size})")
    if torch.unique(index).numel() != index.numel():
        raise InvalidArgument("sparse token ids must be distinct")
    dense = torch.zeros(vocab_size, dtype=torch.float64)  # [vocab]
    dense[index] = values
    return dense


def draft_probs_from_pb(
    distributions: Sequence[common_pb2.DraftDistribution], vocab_size: int
) -> torch.Tensor:
    """Wire distributions -> ``[gamma, vocab]`` float64 through :func:`check_distribution`.

    Dense rows are little-endian float32 bytes of exactly ``vocab_size``
    entries; sparse rows list their support. The result is bitwise what the draft
    sampled from when it called ``check_distribution`` on its float32 vector.
    """
    rows: list[torch.Tensor] = []
    for i, dist in enumerate(distributions):
        kind = dist.WhichOneof("support")
        if kind == "dense":
            raw = dist.dense.probs_f32le
            if len(raw) != 4 * vocab_size:
                raise VocabularyMismatch(
                    f"dense distribution {i} has {len(raw)} bytes, expected 4 * vocab_size = {4 * vocab_size}"
                )
            with np.errstate(invalid="ignore"):  # a NaN's bytes: check_distribution below rejects the row
                rows.append(torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float64)))
        elif kind == "sparse":
            rows.append(dense_from_sparse(list(dist.sparse.token_ids), list(dist.sparse.probs), vocab_size))
        else:
            raise InvalidArgument(f"draft distribution {i} has neither a dense nor a sparse support")
    if not rows:
        return torch.zeros((0, vocab_size), dtype=torch.float64)
    return check_distribution(torch.stack(rows))  # [gamma, vocab] float64


def draft_probs_to_pb(probs_f32: torch.Tensor, sparse: bool) -> list[common_pb2.DraftDistribution]:
    """``[gamma, vocab]`` float32 -> wire distributions (dense bytes, or the non-zero support).

    The draft samples from ``check_distribution(probs_f32)``; the target
    rebuilds exactly that tensor with :func:`draft_probs_from_pb`.
    """
    if probs_f32.dim() != 2 or probs_f32.dtype != torch.float32:
        raise InvalidArgument(
            f"draft probs must be [gamma, vocab] float32, got {tuple(probs_f32.shape)} {probs_f32.dtype}"
        )
    host = probs_f32.detach().to("cpu").contiguous()  # [gamma, vocab]
    out: list[common_pb2.DraftDistribution] = []
    for row in host:
        if sparse:
            support = torch.nonzero(row).reshape(-1)  # [support]
            out.append(
                common_pb2.DraftDistribution(
                    sparse=common_pb2.SparseDistribution(
                        token_ids=support.tolist(), probs=row[support].tolist()
                    )
                )
            )
        else:
            raw = row.numpy().astype("<f4", copy=False).tobytes()
            out.append(common_pb2.DraftDistribution(dense=common_pb2.DenseDistribution(probs_f32le=raw)))
    return out
