"""The feature head's wire cost and its speed where verifying is cheap: one measured figure, two projections.

The head card (:mod:`specserve.bench.head_card`) and the harness's tables (single stream, load sweep, RTT
sweep: :mod:`specserve.bench.report`, :mod:`specserve.bench.latency`) both compute their head figures here:

* **Bytes on the wire per committed token** (measured): the bytes of the target's features relayed to the
  draft over the tokens committed. The harness reads them from the coordinator's
  ``specserve_coordinator_feature_bytes_total`` counter (hop ``to_draft``; ``from_target`` is the same
  features' first hop, from the target to the coordinator); the card counts the rows it hands the head.
* **The same figure at other hidden sizes** (a projection): the rows per committed token stay what was
  measured, each row ``hidden`` float16 values, at :data:`PROJECTED_TOKENS_PER_S` committed tokens/s.
* **The speedup where a verify pass costs about a decode step** (a projection): the cost model's
  tokens per drafted round over that round's cost in target steps, ``(accepted + 1) / (gamma x c + v)``,
  with ``c`` the head's step over the target's (measured on this CPU by the card) and ``v`` a verify pass
  at :data:`PROJECTED_VERIFY_COSTS` decode steps, as on a GPU with spare parallelism.

Pure arithmetic: no model, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Bytes per feature value on the wire (float16; :data:`specserve.core.features.VALUE_BYTES`).
VALUE_BYTES = 2
#: Hidden sizes and the committed-token rate the wire cost is projected to (7B- and 70B-class targets).
PROJECTED_HIDDEN = (4096, 8192)
PROJECTED_TOKENS_PER_S = 10_000
#: A GPU-like verify pass over gamma + 1 positions, as a multiple of one decode step.
PROJECTED_VERIFY_COSTS = (1.05, 1.2)


def wire_mb_per_s(bytes_per_token: float, hidden: int) -> dict[str, float]:
    """MB/s of features at :data:`PROJECTED_TOKENS_PER_S` committed tokens/s for each hidden size of
    :data:`PROJECTED_HIDDEN`, from ``bytes_per_token`` measured with rows of ``hidden`` values (the rows per
    committed token kept, each row's size scaled)."""
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    rows_per_token = bytes_per_token / (hidden * VALUE_BYTES)
    return {str(h): rows_per_token * h * VALUE_BYTES * PROJECTED_TOKENS_PER_S / 1e6 for h in PROJECTED_HIDDEN}


def gpu_like_speedup(accepted_per_round: float, gamma: float, head_over_step: float) -> dict[str, float]:
    """Per verify cost of :data:`PROJECTED_VERIFY_COSTS`: tokens per drafted round (``accepted_per_round``
    draft tokens accepted and the target's own) over ``gamma`` head steps of ``head_over_step`` target
    steps each plus the verify pass (``gamma`` may be a mean, for a policy that varies it)."""
    return {str(v): (accepted_per_round + 1.0) / (gamma * head_over_step + v) for v in PROJECTED_VERIFY_COSTS}


@dataclass(frozen=True)
class HeadFigures:
    """A head mode's figures over some generations: measured bytes per committed token (each hop), the
    measured acceptance per drafted round, and the two projections from them."""

    bytes_per_token: float
    bytes_from_target_per_token: float
    accepted_per_round: float | None
    drafted_per_round: float | None
    wire_mb_per_s: dict[str, float]
    speedup: dict[str, float] | None

    @classmethod
    def of(
        cls,
        *,
        committed: int,
        to_draft_bytes: int,
        from_target_bytes: int,
        proposed: int,
        accepted: int,
        draft_rounds: int,
        hidden: int,
        head_over_step: float | None,
    ) -> HeadFigures:
        """From counts summed over generations (``head_over_step`` None: no cost ratio, no speedup)."""
        per_token = to_draft_bytes / max(committed, 1)
        apr = accepted / draft_rounds if draft_rounds else None
        dpr = proposed / draft_rounds if draft_rounds else None
        speedup = (
            gpu_like_speedup(apr, dpr, head_over_step)
            if apr is not None and dpr is not None and head_over_step is not None
            else None
        )
        return cls(
            bytes_per_token=per_token,
            bytes_from_target_per_token=from_target_bytes / max(committed, 1),
            accepted_per_round=apr,
            drafted_per_round=dpr,
            wire_mb_per_s=wire_mb_per_s(per_token, hidden),
            speedup=speedup,
        )


def figures(
    head: dict[str, Any] | None,
    *,
    committed: int,
    to_draft_bytes: int,
    from_target_bytes: int,
    proposed: int,
    accepted: int,
    draft_rounds: int,
) -> dict[str, Any] | None:
    """:class:`HeadFigures` as JSON from counts summed over generations, for the served ``head``
    (:func:`specserve.bench.runner.head_info`: its ``hidden`` and ``head_over_target_step``); None where no
    head is served or nothing was relayed (the generations drafted with something else)."""
    if head is None or to_draft_bytes == 0:
        return None
    return asdict(
        HeadFigures.of(
            committed=committed,
            to_draft_bytes=to_draft_bytes,
            from_target_bytes=from_target_bytes,
            proposed=proposed,
            accepted=accepted,
            draft_rounds=draft_rounds,
            hidden=head["hidden"],
            head_over_step=head["head_over_target_step"],
        )
    )


def run_figures(runs: Sequence[Any], head: dict[str, Any] | None) -> dict[str, Any] | None:
    """:func:`figures` of timed runs (each with ``tokens``, ``feature_bytes_to_draft``,
    ``feature_bytes_from_target``, ``proposed``, ``accepted`` and ``draft_rounds``), summed."""
    return figures(
        head,
        committed=sum(r.tokens for r in runs),
        to_draft_bytes=sum(r.feature_bytes_to_draft for r in runs),
        from_target_bytes=sum(r.feature_bytes_from_target for r in runs),
        proposed=sum(r.proposed for r in runs),
        accepted=sum(r.accepted for r in runs),
        draft_rounds=sum(r.draft_rounds for r in runs),
    )


def cells(f: dict) -> list[str]:
    """A :class:`HeadFigures` (as JSON) as table cells, in the order of :data:`HEADER`."""
    speed = f.get("speedup") or {}
    return [
        f"{f['bytes_per_token']:.0f}",
        f"{f['bytes_from_target_per_token']:.0f}",
        *(f"{f['wire_mb_per_s'][str(h)]:.0f}" for h in PROJECTED_HIDDEN),
        *(f"{speed[str(v)]:.2f}x" if str(v) in speed else "-" for v in PROJECTED_VERIFY_COSTS),
    ]


#: The head columns of a table: measured bytes, then the projections (labelled as such).
HEADER: tuple[str, ...] = (
    "feature B/token to the draft (measured)",
    "B/token from the target (measured)",
    *(f"MB/s at hidden {h:,}, {PROJECTED_TOKENS_PER_S:,} tok/s (projection)" for h in PROJECTED_HIDDEN),
    *(f"speedup, verify {v:g}x a step (projection)" for v in PROJECTED_VERIFY_COSTS),
)


def note(head_over_step: float | None) -> str:
    """The sentence under a head table: where each figure comes from."""
    ratio = f"{head_over_step:.3f}" if head_over_step is not None else "unknown (no head card)"
    return (
        "Bytes are the coordinator's `specserve_coordinator_feature_bytes_total` counter over the committed "
        "tokens (to the draft: the relay's hop, the head card's figure; from the target: the same rows' first "
        "hop). **Projections, not measurements**: MB/s keeps the measured rows per committed token with rows of "
        f"{'/'.join(f'{h:,}' for h in PROJECTED_HIDDEN)} float16 values at {PROJECTED_TOKENS_PER_S:,} committed "
        "tokens/s; the speedup is the cost model's (accepted per drafted round + 1) / (drafted per round x "
        f"head step + verify), the head step {ratio} of a target step (the head card's measurement on this "
        "CPU) and a verify pass at "
        + " and ".join(f"{v:g}" for v in PROJECTED_VERIFY_COSTS)
        + " decode steps, as on a GPU."
    )
