"""``specserve demo``: three requests through a running stack, each beside the target alone.

1. **a chat answer** (the target's chat template), the default request: the
   server's default proposer drafts (the stack's, which the statistics name);
2. **a code request** (chat), the default request too;
3. **output that repeats its input** (a function to repeat), the default
   request again: under the adaptive policy it also drafts from a prompt lookup
   over its own tokens, which needs no model, where the text repeats
   (docs/design.md, "The hybrid lookup").

Each runs greedy with speculation (adaptive gamma unless ``--gamma``), then the
target alone twice: Hugging Face ``generate()`` outside the service (stock
transformers, float32: what a user without specserve runs, and what the speedup
is against; :mod:`specserve.launch.baseline`), and the same request through the
service at gamma 0 with the same seed (whose output the speculative one must
equal). It prints the statistics, the speedup over ``generate()`` and whether the
outputs are token-identical. The closing summary says plainly where speculation
paid on this machine and where it did not, with the measured numbers, and names
the baseline.

Only the SDK is used here (the baseline is passed in); the launcher (:mod:`specserve.launch.cli`) starts
the stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from specserve.client import AsyncClient, GenerateResult
from specserve.launch.baseline import NAME as HF_NAME
from specserve.launch.baseline import Baseline

#: Speculation "pays" when it is at least this much faster than the target alone.
PAYS = 1.10
#: At most this share of rounds drafting counts as the policy's probes out of gamma 0, not as speculating.
PROBE_SHARE = 0.2


@dataclass(frozen=True)
class Scenario:
    title: str
    messages: tuple[dict[str, str], ...]
    proposer: str | None  # None: the server's default (the stats say which it was)


SCENARIOS = (
    Scenario(
        "a chat answer",
        ({"role": "user", "content": "What is a hash table? Explain it in two sentences."},),
        None,
    ),
    Scenario(
        "a code request",
        ({"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},),
        None,
    ),
    Scenario(
        "output that repeats its input (a prompt lookup drafts the copy)",
        (
            {
                "role": "user",
                "content": "Repeat this Python function exactly as it is, in a code block, with no "
                "explanation:\n\n```python\ndef area(width, height):\n"
                '    """Return the area of a rectangle of the given *width* and *height*."""\n'
                "    if width < 0 or height < 0:\n"
                '        raise ValueError("width and height must not be negative")\n'
                "    result = width * height\n    return result\n```",
            },
        ),
        None,
    ),
)


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    spec: GenerateResult
    alone: GenerateResult | None  # the same request at gamma 0 through the service
    baseline: Baseline | None = None  # HF generate() of the target alone, outside the service

    @property
    def against(self) -> str:
        """What :attr:`speedup` is over."""
        return HF_NAME if self.baseline is not None else "gamma 0 through this service"

    @property
    def speedup(self) -> float | None:
        base = self.baseline.tokens_per_s if self.baseline is not None else None
        if base is None and self.alone is not None:
            base = self.alone.stats.tokens_per_s
        if not base:
            return None
        return self.spec.stats.tokens_per_s / base

    @property
    def identical(self) -> bool | None:
        return None if self.alone is None else self.alone.token_ids == self.spec.token_ids


#: Runs the target alone outside the service: (messages, max_new_tokens, temperature, seed) -> Baseline.
BaselineRunner = Callable[[list[dict[str, str]], int, float, "int | None"], Baseline]


async def run_scenario(
    client: AsyncClient,
    scenario: Scenario,
    *,
    gamma: int | None,
    compare: bool,
    out: TextIO,
    baseline: BaselineRunner | None = None,
    **request: Any,
) -> Outcome:
    """Stream ``scenario`` with speculation, then (``compare``) the target alone: ``baseline`` outside the
    service where given, and the same request through the service at gamma 0."""
    messages = [dict(m) for m in scenario.messages]
    out.write(f"user> {messages[-1]['content']}\n\nassistant> ")
    async with client.stream_chat(messages, gamma=gamma, proposer=scenario.proposer, **request) as stream:
        async for chunk in stream:
            out.write(chunk.text)
            out.flush()
    spec = stream.result
    label = "gamma auto" if gamma is None else f"gamma {gamma}"
    out.write(f"\n\n-- speculative decoding ({_proposer(scenario, spec)}, {label}) --\n")
    out.write(spec.stats.summary() + "\n")
    alone = base = None
    if compare:
        if baseline is not None:
            base = baseline(messages, request["max_new_tokens"], request["temperature"], spec.stats.seed)
            out.write(f"-- the target alone: {HF_NAME}, stock transformers, float32, in this process --\n")
            out.write(f"tokens {len(base.token_ids)} | time {base.seconds:.3f} s ({base.tokens_per_s:.1f} tokens/s)\n")
        alone = await client.chat(messages, gamma=0, **{**request, "seed": spec.stats.seed})
        out.write("-- the target alone through this service (gamma = 0), same request --\n")
        out.write(alone.stats.summary() + "\n")
    outcome = Outcome(scenario, spec, alone, base)
    if outcome.speedup is not None:
        same = {True: "identical to", False: "DIFFERENT from", None: "not compared with"}[outcome.identical]
        out.write(f"=> {outcome.speedup:.2f}x {outcome.against} | output {same} the target alone's (gamma 0)\n")
    return outcome


#: What the demo calls each proposer (the SDK's names), long and short.
PROPOSER_LABELS = {
    "model": ("draft model", "model"),
    "feature": ("feature head", "feature"),
    "ngram": ("n-gram", "ngram"),
}


def _drafter(result: GenerateResult, scenario: Scenario) -> str:
    """The proposer that drafted the request: the one it named, or what the server reported it defaulted to
    (the draft model from a server that does not say)."""
    return scenario.proposer or result.stats.proposer or "model"


def _proposer(scenario: Scenario, result: GenerateResult, *, short: bool = False) -> str:
    """What drafted the request's tokens: its proposer, and the prompt lookup where it drafted too."""
    long_name, short_name = PROPOSER_LABELS[_drafter(result, scenario)]
    name = short_name if short else long_name
    if result.stats.lookup_proposed_tokens:
        name += " + lookup" if short else " + prompt lookup"
    return name


def summary(outcomes: list[Outcome], *, must_match: bool = True) -> str:
    """A table of the runs and a plain verdict: where speculation paid here and where it did not."""
    against = next((o.against for o in outcomes if o.speedup is not None), "the target alone")
    lines = [
        "",
        f"== summary (speedup: over {against}, the target alone) ==",
        f"{'request':<34} {'proposer':<15} {'accepted':>9} {'tok/round':>9} {'speedup':>8}",
    ]
    for o in outcomes:
        s = o.spec.stats
        speed = "-" if o.speedup is None else f"{o.speedup:.2f}x"
        title = o.scenario.title.split(" (")[0][:34]
        lines.append(
            f"{title:<34} {_proposer(o.scenario, o.spec, short=True):<15} {100 * s.acceptance_rate:>8.0f}% "
            f"{s.tokens_per_round:>9.2f} {speed:>8}"
        )
    compared = [o for o in outcomes if o.speedup is not None]
    if not compared:
        return "\n".join(lines)
    if must_match and all(o.identical for o in compared):
        lines.append("every speculative output was token-identical to the target alone, as it must be.")
    elif must_match:
        lines.append("SOME OUTPUTS DIFFER from the target alone's: that is a bug, please report it.")
    else:
        lines.append("sampled with the optimal rule: the text may differ from the target alone's (same distribution).")
    # The draft model's verdict: the requests it drafted alone (a prompt lookup's copied runs are not its).
    model = [o for o in compared if o.scenario.proposer is None and not o.spec.stats.lookup_proposed_tokens]
    # A run that accepted no draft token ran the target alone, as its comparison did: its ratio is noise.
    paying = [o for o in compared if o.speedup >= PAYS and o.spec.stats.accepted_tokens > 0]  # type: ignore[union-attr]
    if model and not any(o in paying for o in model):
        best = max(model, key=lambda o: o.speedup)
        spec, alone = best.spec.stats, best.alone.stats  # type: ignore[union-attr]
        spec_round = 1e3 * spec.total_s / max(spec.rounds, 1)
        plain_round = 1e3 * alone.total_s / max(alone.rounds, 1)
        noise = (
            " (no draft token was accepted, so the difference is the machine's noise)"
            if best.speedup >= PAYS and not spec.accepted_tokens
            else ""
        )
        lines.append(
            f"On this machine the {PROPOSER_LABELS[_drafter(best.spec, best.scenario)][0]} "
            f"does not pay: at best {best.speedup:.2f}x {best.against}, the target alone{noise}. "
            f"A speculative round took {spec_round:.1f} ms and committed {spec.tokens_per_round:.2f} tokens "
            f"({100 * spec.acceptance_rate:.0f}% of draft tokens accepted); a round of the target alone took "
            f"{plain_round:.1f} ms for {alone.tokens_per_round:.2f} tokens."
        )
        drafted = sum(o.spec.stats.draft_rounds for o in model)  # type: ignore[union-attr]
        rounds = sum(o.spec.stats.rounds for o in model)  # type: ignore[union-attr]
        if drafted == 0:
            lines.append("The adaptive policy fell back to gamma 0, as it should where speculation does not pay.")
        elif drafted <= PROBE_SHARE * rounds:
            lines.append(
                f"The adaptive policy fell back to gamma 0: it drafted in {drafted} of {rounds} rounds of those "
                "requests, its occasional probes of whether acceptance has changed."
            )
        else:
            lines.append(
                f"The adaptive policy should fall back to gamma 0 where speculation does not pay; it still "
                f"drafted in {drafted} of {rounds} rounds of those requests (docs/benchmarks has the costs)."
            )
    if paying:
        names = ", ".join(f"{o.scenario.title.split(' (')[0]} ({o.speedup:.2f}x)" for o in paying)
        lines.append(f"What pays here, against {against}: {names}.")
    return "\n".join(lines)


async def run_demo(
    client: AsyncClient,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int | None,
    gamma: int | None,
    compare: bool,
    out: TextIO,
    sampling_mode: str | None = None,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
    heading: Callable[[int, Scenario], str] = lambda i, s: f"\n== {i}. {s.title} ==\n",
    baseline: BaselineRunner | None = None,
) -> list[Outcome]:
    """Run every scenario in turn; prints as it goes and returns the outcomes."""
    outcomes = []
    request = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    if sampling_mode is not None:
        request["sampling_mode"] = sampling_mode
    # Greedy output, and coupled output with the same seed, must equal the target alone's; optimal sampled
    # output is an equally exact sample of the same distribution, but other text (docs/design.md).
    must_match = temperature == 0 or sampling_mode == "coupled"
    for i, scenario in enumerate(scenarios, 1):
        out.write(heading(i, scenario))
        outcomes.append(
            await run_scenario(client, scenario, gamma=gamma, compare=compare, out=out, baseline=baseline, **request)
        )
    out.write(summary(outcomes, must_match=must_match) + "\n")
    out.flush()
    return outcomes
