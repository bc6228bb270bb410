"""The benchmark's modes, each named once: the Hugging Face baselines and the specserve request settings.

A mode's name is what the reports and ``bench.json`` key its figures by (docs/benchmarks); the measuring code
(:mod:`specserve.bench.harness`) and the report (:mod:`specserve.bench.report`) both take names from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: Hugging Face ``generate()`` of the target alone, the speed every ratio is against.
HF_TARGET = "hf target-only"
#: HF target-only with PyTorch's stock linear kernels, beside the baselines on the target's kernel path.
HF_STOCK = "hf target-only (stock kernels)"
#: HF assisted generation (``assistant_model=`` the draft).
HF_ASSISTED = "hf assisted"
#: HF prompt-lookup baselines: name -> ``prompt_lookup_num_tokens``. 16 is the coordinator's default
#: ``max_gamma``, the longest proposal the n-gram proposer may make (like for like); 8 as in earlier runs.
HF_LOOKUP: dict[str, int] = {"hf prompt lookup (8)": 8, "hf prompt lookup (16)": 16}
HF_LOOKUP_PREFIX = "hf prompt lookup"


@dataclass(frozen=True)
class SpecMode:
    """One specserve request setting: a fixed ``gamma`` (None: the adaptive policy), the ``proposer`` (None:
    the server's default, the feature head where the draft serves one), the hybrid lookup and
    ``min_confidence`` (None: the server's defaults)."""

    name: str
    gamma: int | None
    proposer: str | None = "model"
    hybrid_lookup: bool | None = None
    min_confidence: float | None = None

    def request(self) -> dict[str, Any]:
        """The request fields this mode sets (``Client.stream``'s keywords)."""
        return {
            "gamma": self.gamma,
            "proposer": self.proposer,
            "hybrid_lookup": self.hybrid_lookup,
            "min_confidence": self.min_confidence,
        }


def fixed(gamma: int, proposer: str = "model") -> SpecMode:
    """The draft model (or ``proposer``) at a fixed gamma: ``specserve gamma=4``, ``specserve feature gamma=2``."""
    label = "" if proposer == "model" else {"ngram": "n-gram ", "feature": "feature "}[proposer]
    return SpecMode(f"specserve {label}gamma={gamma}", gamma, proposer)


def may_use_head(mode: SpecMode) -> bool:
    """Whether ``mode`` can draft with the feature head: it names it, or leaves the proposer to the server,
    whose default is the head where the draft serves one."""
    return mode.proposer in ("feature", None)


GAMMA0 = fixed(0)
#: What a request that sets nothing gets.
ADAPTIVE = SpecMode("specserve adaptive", None, None)
NGRAM_ADAPTIVE = SpecMode("specserve n-gram adaptive", None, "ngram")
MODEL_ONLY = SpecMode("specserve adaptive, model only", None, "model", hybrid_lookup=False)
FIXED_GAMMAS = (1, 2, 4, 8)
#: Every single-stream specserve mode, in the report's order.
SPEC_MODES: tuple[SpecMode, ...] = (
    GAMMA0,
    *(fixed(g) for g in FIXED_GAMMAS),
    fixed(4, "ngram"),
    NGRAM_ADAPTIVE,
    MODEL_ONLY,
    SpecMode("specserve adaptive, whole gamma", None, "model", min_confidence=0.0),
    SpecMode("specserve adaptive, token draft", None, "model"),
    fixed(2, "feature"),
    fixed(4, "feature"),
    SpecMode("specserve adaptive, feature head", None, "feature"),
    ADAPTIVE,
)
BY_NAME: dict[str, SpecMode] = {m.name: m for m in SPEC_MODES}
#: The modes that need the draft tier to serve the feature head (left out where it does not).
HEAD_MODES = frozenset(m.name for m in SPEC_MODES if m.proposer == "feature")
#: Every single-stream mode, baselines first, in the order a prompt's turn runs them.
SINGLE_MODES: tuple[str, ...] = (HF_TARGET, HF_STOCK, HF_ASSISTED, *HF_LOOKUP, *BY_NAME)

#: The load sweep's modes run the draft model (proposer "model"): gamma 0 (the sweep's base), a fixed gamma,
#: adaptive, and gamma 0 measured a second time (``--control``), the A/A control; beside them the feature head
#: at a fixed gamma where the draft serves one.
LOAD_BASE = GAMMA0
LOAD_ADAPTIVE = SpecMode(ADAPTIVE.name, None, "model")
LOAD_CONTROL = SpecMode("specserve gamma=0 (again)", 0, "model")


def head_modes(head_gamma: int | None) -> list[SpecMode]:
    """The feature head at ``head_gamma`` (none where None: the draft serves no head)."""
    return [] if head_gamma is None else [fixed(head_gamma, "feature")]


def load_modes(fixed_gamma: int, control: bool, head_gamma: int | None = None) -> list[SpecMode]:
    """The load sweep's modes: gamma 0, ``fixed_gamma``, adaptive, the feature head at ``head_gamma`` (None:
    none), and with ``control`` gamma 0 again, whose ratio to the first is what the machine's noise alone
    does to a pair of points."""
    return [
        LOAD_BASE, fixed(fixed_gamma), LOAD_ADAPTIVE, *head_modes(head_gamma), *([LOAD_CONTROL] if control else [])
    ]


#: What the RTT sweep appends to a mode's name when the coordinator overlaps drafting with verifying.
OVERLAP = " +overlap"


def latency_modes(fixed_gamma: int, head_gamma: int | None, overlap: bool) -> list[SpecMode]:
    """The RTT sweep's modes on a stack without overlap: gamma 0, the token draft at ``fixed_gamma``, adaptive
    with the token draft, and the feature head at ``head_gamma`` (None: none); with ``overlap``, the token
    draft's two again, named with :data:`OVERLAP` (gamma 0 drafts nothing, and the coordinator drafts no
    feature round ahead: the head needs the features of the round in flight). Names without the
    ``specserve`` prefix, as the sweep's tables have always had them."""
    plain = [GAMMA0, fixed(fixed_gamma), LOAD_ADAPTIVE, *head_modes(head_gamma)]
    modes = [m for m in plain if m.gamma != 0 and m.proposer != "feature"] if overlap else plain
    # Named as the sweep's tables always have: "gamma=1", "adaptive +overlap", "feature gamma=2".
    suffix = OVERLAP if overlap else ""
    return [dataclasses.replace(m, name=m.name.removeprefix("specserve ") + suffix) for m in modes]
