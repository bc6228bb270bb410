"""A generation's closing statistics, one type for the SDK and the coordinator.

The SDK (:mod:`specserve.client` exports it) builds it from the wire with :meth:`GenerationStats.from_pb`; the
coordinator builds it from the session, its gRPC servicer (specserve/coordinator/servicer.py) writes it to the
wire, and its OpenAI replies read it. The fields are the wire's ``GenerationStats`` by the same names, with
``finish_reason`` and ``proposer`` by name (:data:`FINISH_REASON_NAMES`, :data:`PROPOSER_NAMES`), not enum value.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.api.params import FINISH_REASONS, NOT_FINISHED, PROPOSER_KINDS
from specserve.v1 import coordinator_pb2

#: ``ProposerKind`` -> the SDK's name of it.
PROPOSER_NAMES: dict[int, str] = {kind: name for name, kind in PROPOSER_KINDS.items()}
#: ``FinishReason`` -> the SDK's name of it (a session not finished: ``"unspecified"``).
FINISH_REASON_NAMES: dict[int, str] = {
    NOT_FINISHED: "unspecified",
    **{v: k for k, v in FINISH_REASONS.items()},
}


@dataclass(frozen=True)
class SourceStats:
    """One proposal source's share of a generation's speculation (``GenerationStats.sources``)."""

    #: ``"model"``, ``"feature"``, ``"ngram"``, ``"prediction"``, ``"forced"``, or another the server registers.
    name: str
    #: Rounds this source drafted.
    draft_rounds: int = 0
    #: Of ``GenerationStats.proposed_tokens``, those this source drafted.
    proposed_tokens: int = 0
    #: Of ``GenerationStats.accepted_tokens``, those of this source's the target accepted.
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens of this source (0.0 when it proposed nothing)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


@dataclass(frozen=True)
class GenerationStats:
    """Statistics of one generation, as the coordinator measured them (times in nanoseconds)."""

    session_id: str
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    proposed_tokens: int
    accepted_tokens: int
    #: ``accepted_per_position[i]``: rounds whose draft token at position ``i`` was accepted.
    accepted_per_position: tuple[int, ...]
    draft_ns: int
    verify_ns: int
    queue_ns: int
    first_token_ns: int
    total_ns: int
    #: ``"eos"``, ``"stop_token"``, ``"stop_string"`` or ``"length"``.
    finish_reason: str
    seed: int
    #: Rounds that proposed at least one draft token (the rest ran the target alone).
    draft_rounds: int = 0
    #: Predicted Outputs: completion tokens the prediction predicted at their place.
    accepted_prediction_tokens: int = 0
    #: Predicted Outputs: tokens drafted from the prediction and not committed (rejected).
    rejected_prediction_tokens: int = 0
    #: The target's own account of the Verify calls (``verify_ns`` minus this: network, coordinator).
    target_ns: int = 0
    #: The target's forward passes in those calls (a batched pass counted for each session in it).
    forward_ns: int = 0
    #: Of ``proposed_tokens``, those an n-gram lookup in the coordinator drafted (no draft call): the
    #: ``ngram`` proposer's, or the hybrid lookup's of a session drafting with the model.
    lookup_proposed_tokens: int = 0
    #: Of ``accepted_tokens``, those the lookup drafted.
    lookup_accepted_tokens: int = 0
    #: Of ``prompt_tokens``, those the target did not prefill: its prefix cache held them.
    cached_tokens: int = 0
    #: Of ``proposed_tokens``, those a constrained request's forced text drafted (no draft call).
    forced_proposed_tokens: int = 0
    #: Of ``accepted_tokens``, those the forced text drafted.
    forced_accepted_tokens: int = 0
    #: The proposer the session drafted with (``"model"``, ``"ngram"`` or ``"feature"``): the request's, or
    #: the server's default where the request named none ("" from a server that does not say).
    proposer: str = ""
    #: Per proposal source of the session (every one it had, in the order it asked them), what it drafted.
    sources: tuple[SourceStats, ...] = ()

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.GenerationStats) -> GenerationStats:
        return cls(
            session_id=pb.session_id,
            prompt_tokens=pb.prompt_tokens,
            completion_tokens=pb.completion_tokens,
            rounds=pb.rounds,
            proposed_tokens=pb.proposed_tokens,
            accepted_tokens=pb.accepted_tokens,
            accepted_per_position=tuple(pb.accepted_per_position),
            draft_ns=pb.draft_ns,
            verify_ns=pb.verify_ns,
            queue_ns=pb.queue_ns,
            first_token_ns=pb.first_token_ns,
            total_ns=pb.total_ns,
            finish_reason=FINISH_REASON_NAMES.get(pb.finish_reason, str(pb.finish_reason)),
            seed=pb.seed,
            draft_rounds=pb.draft_rounds,
            accepted_prediction_tokens=pb.accepted_prediction_tokens,
            rejected_prediction_tokens=pb.rejected_prediction_tokens,
            target_ns=pb.target_ns,
            forward_ns=pb.forward_ns,
            lookup_proposed_tokens=pb.lookup_proposed_tokens,
            lookup_accepted_tokens=pb.lookup_accepted_tokens,
            cached_tokens=pb.cached_tokens,
            forced_proposed_tokens=pb.forced_proposed_tokens,
            forced_accepted_tokens=pb.forced_accepted_tokens,
            proposer=PROPOSER_NAMES.get(pb.proposer, ""),
            sources=tuple(
                SourceStats(s.name, s.draft_rounds, s.proposed_tokens, s.accepted_tokens) for s in pb.sources
            ),
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0.0 when nothing was proposed)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per round (1.0 is what decoding without speculation gives)."""
        return self.completion_tokens / self.rounds if self.rounds else 0.0

    @property
    def draft_s(self) -> float:
        return self.draft_ns / 1e9

    @property
    def verify_s(self) -> float:
        return self.verify_ns / 1e9

    @property
    def queue_s(self) -> float:
        return self.queue_ns / 1e9

    @property
    def first_token_s(self) -> float:
        return self.first_token_ns / 1e9

    @property
    def total_s(self) -> float:
        return self.total_ns / 1e9

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per second of the request's wall-clock time."""
        return self.completion_tokens / self.total_s if self.total_ns else 0.0

    def summary(self) -> str:
        """These statistics as a few human-readable lines (the CLI prints them)."""
        per_pos = " ".join(str(n) for n in self.accepted_per_position) or "-"
        return "\n".join(
            [
                f"tokens {self.completion_tokens} (prompt {self.prompt_tokens}) | rounds {self.rounds} "
                f"| {self.tokens_per_round:.2f} tokens/round | finish {self.finish_reason}",
                f"draft tokens proposed {self.proposed_tokens}, accepted {self.accepted_tokens} "
                f"({100 * self.acceptance_rate:.1f}%) | accepted per position: {per_pos}",
                f"time {self.total_s:.3f} s ({self.tokens_per_s:.1f} tokens/s) | first token "
                f"{1e3 * self.first_token_s:.1f} ms | draft {self.draft_s:.3f} s | verify "
                f"{self.verify_s:.3f} s | queue {self.queue_s:.3f} s",
                f"session {self.session_id} | seed {self.seed}",
            ]
            + (
                [
                    f"of which from the prompt lookup: proposed {self.lookup_proposed_tokens}, "
                    f"accepted {self.lookup_accepted_tokens}"
                ]
                if self.lookup_proposed_tokens
                else []
            )
            + (
                [
                    f"prediction tokens accepted {self.accepted_prediction_tokens}, "
                    f"rejected {self.rejected_prediction_tokens}"
                ]
                if self.accepted_prediction_tokens or self.rejected_prediction_tokens
                else []
            )
        )
