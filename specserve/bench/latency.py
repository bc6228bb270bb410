"""Network latency between the tiers: what a round trip to the draft or the target costs.

``specserve bench latency`` starts two
stacks of one process per role (``specserve up``'s, as the harness's single-stream
runs), overlap off and on, and puts a :class:`LatencyProxy` between the
coordinator and each tier. A setting delays one tier's link: every byte the
coordinator sends to that tier, and every byte it gets back, arrives ``rtt / 2``
later (an order-preserving delay, not a bandwidth limit: bytes in flight overlap as on a real link). For each
side (draft, target) and each round-trip time (``--rtts-ms``, 0, 2 and 10 by
default) it runs the held-out prompts of the first set greedily, EOS ignored,
with gamma = 0, the token draft at a fixed gamma (``--gamma``, 1), the adaptive
policy with the token draft and, where the draft serves one, the feature head at
``--head-gamma`` (:func:`specserve.bench.modes.latency_modes`), then the token
draft's two again with overlap on (``CoordinatorSettings.overlap``: the draft
drafts the next round while the target verifies; the coordinator drafts no
feature round ahead), and records ms per committed token and the tokens per
round. For the head it also records the feature bytes the coordinator relayed
(:class:`specserve.bench.prom.FeatureBytes`) and the projections of
:mod:`specserve.bench.head_projection`. Greedy output must be the same in
every setting. With overlap on, the coordinator's
``specserve_coordinator_overlap_drafts_total`` counts the drafts made ahead
that the next round used (the verdict bore the hypothesis out: every proposed
token accepted and the bonus token the draft's guess) and those thrown away;
the report gives that hit rate beside what overlap won back.

Two things keep the comparison fair on one small machine:

- **Tiers on cores of their own** (``--cores separate``, the default
  where there are two CPUs): the draft tier and the coordinator run on the
  first CPU, the target on the others with one thread per CPU
  (:func:`tier_cpus`; ``start_process_stack(cpus=)``). Overlap runs the draft
  while the target verifies; on shared cores that drafting takes cores from
  the target's pass, which machines of their own would not.
- **Settings interleaved, on the same processes**: both stacks are up at once
  and the settings (side, RTT, overlap) take turns prompt by prompt,
  ``--repeats`` times (every other repeat in the reverse order), so the
  machine's drift falls on every setting alike. RTT 0 runs through the same
  proxies with no delay, so 'added' is the delay's cost alone, not the hop's.

The draft side is the setting of a draft tier on cheap machines away from the
target tier. What it shows: a round pays one round trip to each tier it calls,
so a speculative round pays the draft's RTT once per ``E[tokens per round]``
tokens while gamma = 0 pays no draft RTT at all; the adaptive policy sees the
round trip in its cost model (``observe_rtt``) and weighs it; overlap hides the
draft's round trip behind the target's pass in the rounds whose hypothesis
holds.

Writes ``<out>/latency.json``; ``specserve.bench.report`` renders ``latency.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from specserve.bench import head_projection
from specserve.bench import markdown as md
from specserve.bench.modes import SpecMode, latency_modes, may_use_head
from specserve.bench.options import LatencyOptions
from specserve.bench.prom import FeatureBytes
from specserve.bench.timing import timed_generate

RTTS_MS = (0.0, 2.0, 10.0)
SIDES = ("draft", "target")


class LatencyProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``; each chunk is delivered ``delay_s`` after it arrived.

    Unlike a proxy that sleeps before each write, chunks in flight do not queue
    behind each other's delays: a reader task stamps each chunk and a writer
    task delivers it at its stamp plus the delay, in order.
    """

    def __init__(self, upstream: str, delay_s: float) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> LatencyProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, chunk = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((loop.time() + self.delay_s, chunk))
            queue.put_nowait(None)
            await sender
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass
class LatencyRun:
    side: str  # the tier behind the proxy
    rtt_ms: float
    mode: str
    prompt: str
    tokens: int
    total_s: float
    rounds: int
    proposed: int
    accepted: int
    identical: bool  # greedy output equal to the prompt's first run (every setting's must be the same)
    ahead_used: int = 0  # overlap: drafts made ahead that the next round used
    ahead_wasted: int = 0  # overlap: drafts made ahead and thrown away
    token_ids: list[int] = field(default_factory=list, repr=False)
    #: The generation's time waiting on the draft tier (``GenerationStats.draft_s``: its Propose calls,
    #: and with overlap the rounds that waited for a draft made ahead), where the draft's RTT lands.
    draft_wait_s: float = 0.0
    #: Rounds that proposed (GenerationStats.draft_rounds), and the feature bytes the coordinator relayed
    #: for the generation, by hop (0 for a mode that does not draft with the head).
    draft_rounds: int = 0
    feature_bytes_to_draft: int = 0
    feature_bytes_from_target: int = 0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.total_s / max(self.tokens, 1)

    @property
    def draft_wait_ms_per_token(self) -> float:
        return 1000.0 * self.draft_wait_s / max(self.tokens, 1)


def tier_cpus(separate: bool = True) -> dict[str, set[int]] | None:
    """The CPUs each role gets: the draft tier and the coordinator on the first CPU, the target on the
    rest (tiers on cores of their own, as on machines of their own); None where ``separate`` is off or
    this process may use fewer than two CPUs (every role shares every core)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not separate or len(allowed) < 2:
        return None
    return {"draft": {allowed[0]}, "coordinator": {allowed[0]}, "target": set(allowed[1:])}


async def measure(
    *,
    target,
    draft,
    redis_url: str,
    prompts: list[tuple[str, list[int]]],
    rtts_ms=RTTS_MS,
    sides=SIDES,
    fixed_gamma: int = 1,
    head_gamma: int | None = None,
    draft_overrides: dict | None = None,
    max_new_tokens: int = 64,
    repeats: int = 2,
    cpus: dict[str, set[int]] | None = None,
    progress=lambda n=1: None,
) -> list[LatencyRun]:
    """Every (side, RTT, mode, prompt) ``repeats`` times; see the module docstring.

    Two stacks are up at once, overlap off and on, each reaching both tiers through a
    :class:`LatencyProxy`; a setting sets the delay on its side's link (none on the other) before its
    generations. The settings take turns, prompt by prompt and repeat by repeat (every other repeat in
    the reverse order), so a machine that slows down in the middle slows every setting alike.
    ``cpus``: each role's CPUs (:func:`tier_cpus`; the target then runs one thread per CPU it has). ``head_gamma``: the feature head's gamma (None: no
    head mode); ``draft_overrides``: the draft's settings (:func:`specserve.bench.runner.head_overrides`)."""
    from specserve.client import AsyncClient
    from specserve.launch.local import start_process_stack
    from specserve.launch.redis_server import free_port

    target_overrides = {} if cpus is None else {"threads": len(cpus["target"])}
    if draft_overrides and "feature_head" in draft_overrides:  # the target makes the feature the head reads
        target_overrides["feature_head"] = draft_overrides["feature_head"]
    runs: list[LatencyRun] = []
    reference: dict[str, list[int]] = {}
    async with contextlib.AsyncExitStack() as up:
        stacks = []  # (modes, client, metrics url, proxies by role), one per overlap setting
        for overlap in (False, True):
            proxies: dict[str, list[LatencyProxy]] = {"draft": [], "target": []}

            async def via(role: str, endpoint: str, proxies=proxies) -> str:
                proxy = await LatencyProxy(endpoint, 0.0).start()
                up.push_async_callback(proxy.stop)
                proxies[role].append(proxy)
                return proxy.address

            metrics_port = free_port()
            stack = await start_process_stack(
                target_model=str(target),
                draft_model=str(draft),
                redis_url=redis_url,
                endpoint_map=via,
                coordinator_overrides={"overlap": overlap, "metrics_port": metrics_port},
                target_overrides=target_overrides,
                draft_overrides=draft_overrides or {},
                cpus=cpus,
            )
            up.push_async_callback(stack.stop)
            client = await up.enter_async_context(AsyncClient(stack.address, timeout=600))
            modes = latency_modes(fixed_gamma, head_gamma, overlap)
            for mode in modes:  # warm-up: connections, caches, the cost model
                await client.generate(prompt_token_ids=prompts[0][1], max_new_tokens=8, **mode.request())
            stacks.append((modes, client, f"http://127.0.0.1:{metrics_port}/metrics", proxies))
        settings = [(side, rtt, *stack) for side in sides for rtt in rtts_ms for stack in stacks]
        for repeat in range(repeats):
            for name, ids in prompts:
                for side, rtt, modes, client, metrics, proxies in settings[:: 1 if repeat % 2 == 0 else -1]:
                    for role, role_proxies in proxies.items():  # the delay on ``side``'s link only
                        for proxy in role_proxies:
                            proxy.delay_s = rtt / 2000.0 if role == side else 0.0
                    for mode in modes:
                        run = await _one(client, metrics, side, rtt, mode, name, ids, max_new_tokens)
                        # Greedy: one output for every setting, the prompt's first run's.
                        run.identical = run.token_ids == reference.setdefault(name, run.token_ids)
                        runs.append(run)
                        progress()
    return runs


async def _one(client, metrics: str, side: str, rtt: float, mode: SpecMode, name: str, ids, max_new_tokens):
    """One greedy generation of ``ids`` through ``client`` in ``mode``, with the overlap counters' and the
    feature bytes' change around it (``identical`` is left for the caller, who holds every setting's
    outputs)."""
    from specserve.bench.prom import scrape

    def ahead(outcome: str) -> int:
        return int(scrape(metrics, "specserve_coordinator_overlap_drafts_total", {"outcome": outcome}))

    feature_metrics = metrics if may_use_head(mode) else None
    used, wasted, features = ahead("used"), ahead("wasted"), FeatureBytes.read(feature_metrics)
    result, total = await timed_generate(
        client, prompt_token_ids=ids, max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True,
        **mode.request(),
    )  # fmt: skip
    s = result.stats
    relayed = FeatureBytes.read(feature_metrics) - features
    return LatencyRun(
        side,
        rtt,
        mode.name,
        name,
        len(result.token_ids),
        total,
        s.rounds,
        s.proposed_tokens,
        s.accepted_tokens,
        True,
        ahead("used") - used,
        ahead("wasted") - wasted,
        token_ids=list(result.token_ids),
        draft_wait_s=s.draft_s,
        draft_rounds=s.draft_rounds,
        feature_bytes_to_draft=relayed.to_draft,
        feature_bytes_from_target=relayed.from_target,
    )


def summarize(runs: list[LatencyRun], head: dict | None = None) -> list[dict]:
    """Median ms/token and tokens per round per (side, RTT, mode); the cost of the RTT against RTT 0; for a
    mode that relayed features, the head figures (``head``: the served head,
    :func:`specserve.bench.runner.head_info`)."""
    rows = []
    keys = dict.fromkeys((r.side, r.rtt_ms, r.mode) for r in runs)
    base = {}
    for side, rtt, mode in keys:
        sel = [r for r in runs if (r.side, r.rtt_ms, r.mode) == (side, rtt, mode)]
        ms = statistics.median(r.ms_per_token for r in sel)
        wait = statistics.median(r.draft_wait_ms_per_token for r in sel)
        if rtt == 0:
            base[(side, mode)] = ms
        rounds = sum(r.rounds for r in sel)
        rows.append(
            {
                "side": side,
                "rtt_ms": rtt,
                "mode": mode,
                "ms_per_token": ms,
                "draft_wait_ms_per_token": wait,
                "tokens_per_round": sum(r.tokens for r in sel) / rounds if rounds else None,
                "acceptance": sum(r.accepted for r in sel) / max(1, sum(r.proposed for r in sel)),
                "added_ms_per_token": ms - base[(side, mode)] if (side, mode) in base else None,
                "identical": all(r.identical for r in sel),
                "n": len(sel),
                "ahead_used": sum(r.ahead_used for r in sel),
                "ahead_wasted": sum(r.ahead_wasted for r in sel),
                "head": head_projection.run_figures(sel, head),
            }
        )
    return rows


def to_json(runs: list[LatencyRun], settings: dict) -> dict:
    return {
        "settings": settings,
        "summary": summarize(runs, settings.get("head")),
        "runs": [
            {k: v for k, v in asdict(r).items() if k != "token_ids"}
            | {"ms_per_token": r.ms_per_token, "draft_wait_ms_per_token": r.draft_wait_ms_per_token}
            for r in runs
        ],
    }


def section(data: dict) -> list[str]:
    """The Markdown section of the report."""
    st = data["settings"]
    cpus = st.get("cpus")
    where = (
        f"the draft tier and the coordinator on CPU {', '.join(map(str, cpus['draft']))}, the target on CPU "
        f"{', '.join(map(str, cpus['target']))} with {len(cpus['target'])} thread(s): tiers on cores of their "
        "own, as on machines of their own"
        if cpus
        else "every role on every core"
    )
    repeats = st.get("repeats", 1)
    shared = st.get("stacks") == "shared"  # a record without the key started one stack per setting
    lines = [
        f"## Network latency between the tiers (greedy, {st['max_new_tokens']} tokens, "
        f"{st['prompts']} held-out {st.get('prompt_set', 'chat')} prompts x {repeats}, "
        + ("two stacks of processes, overlap off and on)" if shared else "one stack of processes per setting)"),
        "",
        f"Command: `{st['command']}`. A proxy delays every byte between the coordinator and one tier by "
        f"RTT / 2 each way; {where}. "
        + (
            "Both stacks reach both tiers through proxies, RTT 0 with no delay, so 'added' is the delay's "
            "cost, not the hop's. "
            if shared
            else ""
        )
        + (
            ("The settings" if shared else "For each tier, every setting's stack is up at once and the settings")
            + " take turns prompt by prompt (each repeat in the other order), so the machine's drift falls on "
            "all alike; ms/token is the median over prompts and repeats. "
            if repeats > 1
            else ""
        )
        + (f"{line} " if (line := md.load_line(data)) else "")
        + "'added' is ms/token above the same mode at RTT 0 on the same side. 'drafted ahead, "
        "used': with overlap, the drafts made while the target verified that the next round could use (the "
        "verdict accepted every proposed token and its bonus token was the draft's guess), of all drafted ahead.",
        "",
    ]
    header = ("tier behind the delay", "RTT ms", "mode", "ms/token", "added ms/token",
              "waiting on the draft ms/token", "tokens/round", "acceptance", "drafted ahead, used",
              "greedy output unchanged")  # fmt: skip
    cells = [
        (r["side"], f"{r['rtt_ms']:g}", r["mode"], f"{r['ms_per_token']:.2f}",
         f"{r['added_ms_per_token']:+.2f}" if r["added_ms_per_token"] is not None else "-",
         f"{r['draft_wait_ms_per_token']:.2f}" if "draft_wait_ms_per_token" in r else "-",
         f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-",
         f"{r['acceptance']:.2f}", _hit_rate(r), "yes" if r["identical"] else "**no**")
        for r in data["summary"]
    ]  # fmt: skip
    lines += [*md.table(header, cells), ""]
    won = won_back(data["summary"])
    if won:
        lines += [
            "What overlap wins back of what the round trip costs: (ms/token without overlap at that RTT - "
            "with overlap) / (without overlap at that RTT - without overlap at RTT 0). End to end, and, for "
            "a delayed draft tier, on the rounds' wait on the draft alone (the Propose calls, and with "
            "overlap the waits for a draft made ahead; the clients' `GenerationStats.draft_s` per token): "
            "the part of a round the draft's RTT lands on and overlap acts on, without the target's pass "
            "and the noise of its ~40-70 ms.",
            "",
        ]
        header = ("tier", "RTT ms", "mode", "latency cost ms/token", "won back by overlap",
                  "draft wait: cost ms/token", "won back of it")  # fmt: skip
        cells = [
            (w["side"], f"{w['rtt_ms']:g}", w["mode"], f"{w['cost_ms']:+.2f}", f"{w['won_back']:.0%}",
             *((f"{wait['cost_ms']:+.2f}", f"{wait['won_back']:.0%}") if (wait := w.get("draft_wait")) else ("-", "-")))
            for w in won
        ]  # fmt: skip
        lines += [*md.table(header, cells), ""]
    heads = [r for r in data["summary"] if r.get("head")]
    if heads:
        lines += [
            "The feature head's wire cost and projections, per setting:",
            "",
            *md.table(
                ("tier", "RTT ms", "mode", *head_projection.HEADER),
                [(r["side"], f"{r['rtt_ms']:g}", r["mode"], *head_projection.cells(r["head"])) for r in heads],
            ),
            "",
            head_projection.note((st.get("head") or {}).get("head_over_target_step")),
            "",
        ]
    return lines


def _hit_rate(row: dict) -> str:
    """'used of drafted ahead (share)', or '-' where nothing was drafted ahead (overlap off, or gamma 0)."""
    used, wasted = row.get("ahead_used", 0), row.get("ahead_wasted", 0)
    return f"{used} of {used + wasted} ({used / (used + wasted):.0%})" if used + wasted else "-"


def won_back(summary: list[dict]) -> list[dict]:
    """Per (side, RTT > 0, mode with an overlap twin): the latency's cost and the share overlap recovers.

    Twice: on ms per token end to end, and, behind a delayed draft tier, on the rounds' wait on the draft
    alone (``draft_wait_ms_per_token``), where that RTT lands and overlap acts, free of the target's pass
    and its noise (None where the wait did not grow, or the runs predate the field)."""
    rows = {(r["side"], r["rtt_ms"], r["mode"]): r for r in summary}

    def recovered(key: str, row: dict, twin: dict, base: dict) -> dict | None:
        """What the RTT added to ``key`` (against RTT 0) and the share of it overlap took off; None when
        it added nothing."""
        cost = row[key] - base[key]
        return {"cost_ms": cost, "won_back": (row[key] - twin[key]) / cost} if cost > 0 else None

    out = []
    for (side, rtt, mode), row in rows.items():
        twin = rows.get((side, rtt, f"{mode} +overlap"))
        base = rows.get((side, 0.0, mode))
        if rtt <= 0 or twin is None or base is None:
            continue
        end_to_end = recovered("ms_per_token", row, twin, base)
        if end_to_end is None:
            continue
        key = "draft_wait_ms_per_token"
        waits = side == "draft" and all(key in r for r in (row, twin, base))
        out.append(
            {
                "side": side,
                "rtt_ms": rtt,
                "mode": mode,
                **end_to_end,
                "draft_wait": recovered(key, row, twin, base) if waits else None,
            }
        )
    return out


async def measure_for(opts: LatencyOptions) -> dict:
    """``specserve bench latency``: every setting on the first prompt set's held-out prompts, with the run's
    settings."""
    from transformers import AutoTokenizer

    from specserve.bench.prompts import default_prompt_sets, load_prompt_sets
    from specserve.bench.runner import Header, head_gamma_or_reason, head_info, head_overrides, stack_of

    tokenizer = AutoTokenizer.from_pretrained(opts.target, local_files_only=True)
    first = (opts.prompt_sets or default_prompt_sets(tokenizer))[0]
    prompts = load_prompt_sets([first], tokenizer, opts.target, opts.prompts, opts.prompt_chars)[first]
    head = head_info(opts)
    head_gamma = head_gamma_or_reason(opts, head)
    per_rtt = len(latency_modes(opts.gamma, head_gamma, False)) + len(latency_modes(opts.gamma, head_gamma, True))
    total = len(opts.sides) * len(opts.rtts_ms) * per_rtt * len(prompts) * opts.repeats
    with tqdm(total=total, desc="latency", unit="gen") as bar:
        cpus = tier_cpus(opts.cores == "separate")
        runs = await measure(
            **stack_of(opts),
            prompts=prompts,
            rtts_ms=tuple(opts.rtts_ms),
            sides=tuple(opts.sides),
            fixed_gamma=opts.gamma,
            head_gamma=head_gamma,
            draft_overrides=head_overrides(opts),
            cpus=cpus,
            progress=bar.update,
            **opts.pick("max_new_tokens", "repeats"),
        )
    settings = {
        **Header.of(opts).to_json(),
        "prompt_set": first,
        "stacks": "shared",  # two stacks (overlap off, on), every setting a delay on their proxies
        "prompts": len(prompts),
        "rtts_ms": list(opts.rtts_ms),
        "sides": list(opts.sides),
        **opts.pick("max_new_tokens"),
        "fixed_gamma": opts.gamma,
        "head_gamma": head_gamma,
        "head": head,
        **opts.pick("repeats"),
        "cpus": None if cpus is None else {role: sorted(c) for role, c in cpus.items()},
    }
    return to_json(runs, settings)
