"""The soak: a whole stack under mixed load for a long time, with ``kill -9`` of a target replica on a timer.

::

    python scripts/soak.py --minutes 60 --out /work/soak-out            # tiny test pair (default)
    python scripts/soak.py --minutes 3 --kill-every-s 60 --out /tmp/soak  # a short validation run
    python scripts/soak.py --target DIR --draft DIR --minutes 60 ...     # another pair (a model dir each)

It starts a private ``redis-server``, two target replicas, one draft and a coordinator, each its own
``specserve serve ROLE`` process on 127.0.0.1, and runs ``--concurrency`` clients that send gRPC
``Generate`` requests of mixed kinds until the time is up: greedy (model draft), greedy with the n-gram
proposer, greedy with a prediction, greedy with logprobs, sampled (optimal mode), sampled in the coupled
mode with a fixed seed, streams the client cancels after a few tokens, and requests that are invalid on
purpose. Every ``--kill-every-s`` one target replica (alternating) gets SIGKILL and is started again on
the same port.

What it records (docs/reliability.md, "The soak"):

* requests per kind and how each ended; errors split into the client's (the invalid requests' status,
  the streams it cancelled) and the others (anything else a request ended with);
* tokens lost or duplicated: a stream whose token count differs from its closing stats, a greedy
  reply that is not the target's own ``generate()`` (Hugging Face, float32, computed here), a coupled
  reply that differs from the first reply to the same (prompt, seed), logprobs entries that do not
  match the tokens; streamed text that differs from the decoded tokens is counted apart;
* every 10 s: the resident memory (VmRSS) of every process and Redis ``INFO memory`` / ``DBSIZE``.

The JSON (``OUT/soak.json``) is rewritten every minute, so an interrupted run keeps what it saw; the
plot (``OUT/soak.png``) is drawn at the end (``--plot-only`` redraws it from the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specserve.launch.redis_server import RedisServer, free_port  # noqa: E402
from specserve.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

TEXTS = (
    "class Point:\n    def",
    "for i in range(",
    "def add(a, b):",
    "import os\nimport",
    "the quick brown",
    "if x is None:\n",
    "while True:\n",
    "def sub(a, b):\n    return",
)
KINDS = ("greedy", "ngram", "prediction", "logprobs", "sampled", "coupled", "cancelled", "invalid")
CLIENT_CODES = {"INVALID_ARGUMENT", "CANCELLED_BY_CLIENT"}
SAMPLE_EVERY_S = 10.0
CHECKPOINT_EVERY_S = 60.0


# --------------------------------------------------------------------------- processes


@dataclass
class Role:
    name: str  # "target0", "target1", "draft", "coordinator"
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.starts} at {time.time():.0f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specserve.launch.cli", "serve", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
            )

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill9()


def _serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(roles: list[Role], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    for role in roles:
        while not _serving(role.address):
            if role.proc is not None and role.proc.poll() is not None:
                raise RuntimeError(f"{role.name} exited; see {role.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role.name} not serving after {timeout_s} s; see {role.log_path}")
            time.sleep(0.5)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def tiny_pair(root: Path) -> tuple[Path, Path]:
    """The tests' tiny float32 Llama pair (``tests/tiny_models.py``), saved under ``root``."""
    sys.path.insert(0, str(REPO / "tests"))
    import tiny_models

    if (root / "target" / "config.json").exists() and (root / "draft" / "config.json").exists():
        return root / "target", root / "draft"
    return tiny_models.make_tiny_pair(root)


# --------------------------------------------------------------------------- references


class References:
    """The target's own greedy ``generate()`` per prompt (float32, Hugging Face), and the first reply
    seen per coupled (prompt, seed)."""

    def __init__(self, target_dir: Path, prompts: list[list[int]], max_new: int, eos: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.greedy: list[list[int]] = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new,
                    eos_token_id=None,
                    pad_token_id=eos if eos is not None else 0,
                )
            self.greedy.append(out[0, len(prompt) :].tolist())
        self.coupled: dict[tuple[int, int, int], list[int]] = {}


# --------------------------------------------------------------------------- the load


@dataclass
class Tally:
    started: Counter = field(default_factory=Counter)
    outcomes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    tokens: int = 0
    lost_or_duplicated: int = 0
    text_mismatch: int = 0
    problems: list[dict[str, Any]] = field(default_factory=list)

    def problem(self, kind: str, what: str, **details: Any) -> None:
        if len(self.problems) < 200:
            self.problems.append({"t": time.time(), "kind": kind, "what": what, **details})

    def summary(self) -> dict[str, Any]:
        client = sum(n for c in self.outcomes.values() for code, n in c.items() if code in CLIENT_CODES)
        served = sum(c["OK"] for c in self.outcomes.values())
        other = sum(
            n for c in self.outcomes.values() for code, n in c.items() if code not in CLIENT_CODES | {"OK"}
        )
        return {
            "requests_started": sum(self.started.values()),
            "requests_served": served,
            "client_errors": client,
            "other_errors": other,
            "tokens_streamed": self.tokens,
            "tokens_lost_or_duplicated": self.lost_or_duplicated,
            "text_mismatches": self.text_mismatch,
            "by_kind": {k: dict(self.outcomes[k]) for k in KINDS},
            "problems": self.problems,
        }


def build_request(
    kind: str,
    rng: random.Random,
    prompts: list[list[int]],
    refs: References,
    texts_out: list[str],
    max_new: int,
) -> tuple[coordinator_pb2.GenerateRequest, dict[str, Any]]:
    i = rng.randrange(len(prompts))
    n = rng.randint(max(4, max_new // 4), max_new)
    meta: dict[str, Any] = {"prompt": i, "n": n}
    sampling = common_pb2.SamplingParams(temperature=0.0)
    speculation = coordinator_pb2.SpeculationParams(proposer=common_pb2.PROPOSER_KIND_MODEL)
    if rng.random() < 0.5:
        speculation.gamma = rng.choice([0, 1, 2, 4])
    req = coordinator_pb2.GenerateRequest(
        sampling=sampling,
        stop=common_pb2.StopConditions(max_new_tokens=n, ignore_eos=True),
        speculation=speculation,
    )
    req.tokens.token_ids.extend(prompts[i])
    if kind == "ngram":
        req.speculation.proposer = common_pb2.PROPOSER_KIND_NGRAM
    elif kind == "prediction":
        req.prediction.text = texts_out[i]
    elif kind == "logprobs":
        req.logprobs.top_logprobs = rng.choice([0, 2, 5])
    elif kind == "sampled":
        req.sampling.temperature = 0.8
        req.sampling.top_k = rng.choice([0, 20])
    elif kind == "coupled":
        seed = rng.randrange(3)
        n = max_new  # one length per (prompt, seed): the replies must be identical
        req.stop.max_new_tokens = n
        meta.update(seed=seed, n=n)
        req.sampling.temperature = 1.0
        req.sampling.seed = seed
        req.sampling.sampling_mode = common_pb2.SAMPLING_MODE_COUPLED
    elif kind == "cancelled":
        meta["cancel_after"] = rng.randint(1, max(1, n // 2))
    elif kind == "invalid":
        bad = rng.randrange(3)
        if bad == 0:
            req.sampling.temperature = -1.0
        elif bad == 1:
            req.sampling.top_p = 2.0
        else:
            req.logprobs.top_logprobs = 99
    return req, meta


async def one_request(
    stub: Any, kind: str, req: Any, meta: dict[str, Any], refs: References, tally: Tally, decode: Any
) -> None:
    tally.started[kind] += 1
    tokens: list[int] = []
    text: list[str] = []
    logprob_entries = 0
    stats = None
    call = stub.Generate(req, timeout=300)
    code = "OK"
    try:
        async for reply in call:
            if reply.WhichOneof("event") == "chunk":
                tokens.extend(reply.chunk.token_ids)
                text.append(reply.chunk.text)
                logprob_entries += len(reply.chunk.logprobs)
                if kind == "cancelled" and len(tokens) >= meta["cancel_after"]:
                    call.cancel()
                    code = "CANCELLED_BY_CLIENT"
                    break
            else:
                stats = reply.stats
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
        expected = {"invalid": "INVALID_ARGUMENT", "cancelled": "CANCELLED"}.get(kind)
        if code != expected:
            tally.problem(kind, "status", code=code, details=(exc.details() or "")[:300], **meta)
    except asyncio.CancelledError:
        if kind != "cancelled":
            raise
        code = "CANCELLED_BY_CLIENT"
    if kind == "invalid" and code == "OK":
        tally.problem(kind, "an invalid request was served", **meta)
    if code == "CANCELLED":
        code = "CANCELLED_BY_CLIENT" if kind == "cancelled" else code
    tally.outcomes[kind][code] += 1
    tally.tokens += len(tokens)
    if code != "OK":
        return
    if stats is None or stats.completion_tokens != len(tokens) or len(tokens) != meta["n"]:
        tally.lost_or_duplicated += 1
        tally.problem(
            kind,
            "token count",
            streamed=len(tokens),
            stats=None if stats is None else stats.completion_tokens,
            **meta,
        )
    if kind in ("greedy", "ngram", "prediction", "logprobs"):
        expected = refs.greedy[meta["prompt"]][: meta["n"]]
        if tokens != expected:
            tally.lost_or_duplicated += 1
            first = next(
                (j for j, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
                min(len(tokens), len(expected)),
            )
            tally.problem(kind, "greedy differs from generate()", first_difference=first, **meta)
    if kind == "logprobs" and logprob_entries != len(tokens):
        tally.lost_or_duplicated += 1
        tally.problem(kind, "logprobs entries", entries=logprob_entries, tokens=len(tokens), **meta)
    if kind == "coupled":
        key = (meta["prompt"], meta["seed"], meta["n"])
        first = refs.coupled.setdefault(key, tokens)
        if tokens != first:
            tally.lost_or_duplicated += 1
            tally.problem(kind, "coupled reply differs from the first one", **meta)
    if "".join(text) != decode(tokens):
        tally.text_mismatch += 1
        tally.problem(kind, "streamed text differs from the decoded tokens", **meta)


async def client_loop(
    worker: int,
    address: str,
    deadline: float,
    prompts: list[list[int]],
    refs: References,
    texts_out: list[str],
    tally: Tally,
    decode: Any,
    max_new: int,
) -> None:
    rng = random.Random(1000 + worker)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, weights=(3, 2, 2, 2, 2, 2, 1, 1))[0]
            req, meta = build_request(kind, rng, prompts, refs, texts_out, max_new)
            await one_request(stub, kind, req, meta, refs, tally, decode)


# --------------------------------------------------------------------------- the run


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.tally = Tally()
        self.t0 = time.time()

    def roles(self, target_dir: Path, draft_dir: Path, redis_url: str) -> dict[str, Role]:
        worker = [
            "--redis-url",
            redis_url,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-warmup",
            "--log-level",
            "warning",
        ]
        roles: dict[str, Role] = {}
        for name, model in (("target0", target_dir), ("target1", target_dir), ("draft", draft_dir)):
            port = free_port()
            roles[name] = Role(
                name,
                [
                    "target" if name.startswith("target") else "draft",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--model",
                    str(model),
                    *worker,
                ],
                port,
                self.logs / f"{name}.log",
            )
        port = free_port()
        roles["coordinator"] = Role(
            "coordinator",
            [
                "coordinator",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--redis-url",
                redis_url,
                "--tokenizer",
                str(target_dir),
                "--log-level",
                "warning",
                "--target-endpoints",
                f"{roles['target0'].address},{roles['target1'].address}",
                "--draft-endpoints",
                roles["draft"].address,
            ],
            port,
            self.logs / "coordinator.log",
        )
        return roles

    def sample(self, roles: dict[str, Role], redis_client: Any) -> None:
        row: dict[str, Any] = {"t_s": round(time.time() - self.t0, 1)}
        for name, role in roles.items():
            row[f"rss_mib.{name}"] = rss_mib(role.proc.pid) if role.proc is not None else None
        with contextlib.suppress(Exception):
            info = redis_client.info("memory")
            row["redis.used_memory_mib"] = info["used_memory"] / 2**20
            row["redis.used_memory_rss_mib"] = info["used_memory_rss"] / 2**20
            row["redis.keys"] = redis_client.dbsize()
        row["rss_mib.redis"] = rss_mib(self.redis.proc.pid) if self.redis.proc is not None else None
        row["requests_served"] = sum(c["OK"] for c in self.tally.outcomes.values())
        self.samples.append(row)

    def report(self, finished: bool) -> dict[str, Any]:
        return {
            "command": " ".join(sys.argv),
            "pair": self.pair_name,
            "minutes": self.args.minutes,
            "concurrency": self.args.concurrency,
            "kill_every_s": self.args.kill_every_s,
            "max_new_tokens": self.args.max_new_tokens,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.t0)),
            "elapsed_s": round(time.time() - self.t0, 1),
            "finished": finished,
            "kills": self.events,
            **self.tally.summary(),
            "samples": self.samples,
        }

    def checkpoint(self, finished: bool = False) -> None:
        path = self.out / "soak.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report(finished), indent=1))
        tmp.replace(path)

    async def killer(self, roles: dict[str, Role], deadline: float) -> None:
        victims = [roles["target0"], roles["target1"]]
        k = 0
        while True:
            wake = self.t_start + (k + 1) * self.args.kill_every_s
            if wake >= deadline - 5:
                return
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            victim = victims[k % 2]
            event = {"t_s": round(time.time() - self.t0, 1), "killed": victim.name, "pid": victim.proc.pid}
            victim.kill9()
            await asyncio.sleep(self.args.down_s)
            victim.start()
            await asyncio.to_thread(wait_serving, [victim])
            event["serving_again_after_s"] = round(time.time() - self.t0 - event["t_s"], 1)
            event["new_pid"] = victim.proc.pid
            self.events.append(event)
            k += 1

    async def sampler(self, roles: dict[str, Role], redis_client: Any, stop: asyncio.Event) -> None:
        last_checkpoint = time.monotonic()
        while not stop.is_set():
            await asyncio.to_thread(self.sample, roles, redis_client)
            if time.monotonic() - last_checkpoint >= CHECKPOINT_EVERY_S:
                await asyncio.to_thread(self.checkpoint)
                last_checkpoint = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)

    def run(self) -> dict[str, Any]:
        import redis
        from transformers import AutoTokenizer

        args = self.args
        if args.target:
            target_dir, draft_dir = Path(args.target), Path(args.draft)
            self.pair_name = f"{target_dir} / {draft_dir}"
        else:
            target_dir, draft_dir = tiny_pair(self.out / "pair")
            self.pair_name = "tiny (tests/tiny_models.py make_tiny_pair, float32 Llama)"
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
        refs = References(target_dir, prompts, args.max_new_tokens, tokenizer.eos_token_id)
        texts_out = [tokenizer.decode(r) for r in refs.greedy]

        def decode(tokens: list[int]) -> str:
            return tokenizer.decode(tokens, skip_special_tokens=True)

        self.redis = RedisServer(Path(tempfile.mkdtemp(prefix="soak-redis-"))).start()
        roles = self.roles(target_dir, draft_dir, self.redis.url)
        try:
            for name in ("target0", "target1", "draft"):
                roles[name].start()
            wait_serving([roles["target0"], roles["target1"], roles["draft"]])
            roles["coordinator"].start()
            wait_serving([roles["coordinator"]])
            redis_client = redis.Redis.from_url(self.redis.url)
            asyncio.run(self._load(roles, redis_client, prompts, refs, texts_out, decode))
        finally:
            for role in roles.values():
                role.stop()
            self.redis.stop()
        self.checkpoint(finished=True)
        plot(self.out / "soak.json", self.out / "soak.png")
        return self.report(True)

    async def _load(self, roles, redis_client, prompts, refs, texts_out, decode) -> None:
        self.t_start = time.monotonic()
        deadline = self.t_start + self.args.minutes * 60
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(roles, redis_client, stop))
        killer = asyncio.create_task(self.killer(roles, deadline))
        clients = [
            asyncio.create_task(
                client_loop(
                    w,
                    roles["coordinator"].address,
                    deadline,
                    prompts,
                    refs,
                    texts_out,
                    self.tally,
                    decode,
                    self.args.max_new_tokens,
                )
            )
            for w in range(self.args.concurrency)
        ]
        await asyncio.gather(*clients)
        await killer
        stop.set()
        await sampler
        self.sample(roles, redis_client)


def plot(json_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(json_path.read_text())
    samples = report["samples"]
    t = [s["t_s"] / 60 for s in samples]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for key in sorted({k for s in samples for k in s if k.startswith("rss_mib.")}):
        ax1.plot(t, [s.get(key) for s in samples], label=key.removeprefix("rss_mib."))
    ax1.set_ylabel("resident memory (MiB)")
    ax1.legend(loc="upper left", fontsize=8, ncol=3)
    ax2.plot(t, [s.get("redis.used_memory_mib") for s in samples], label="used_memory")
    ax2.plot(t, [s.get("redis.used_memory_rss_mib") for s in samples], label="used_memory_rss")
    ax2.set_ylabel("Redis memory (MiB)")
    ax2b = ax2.twinx()
    ax2b.plot(t, [s.get("redis.keys") for s in samples], color="grey", linestyle=":", label="keys")
    ax2b.set_ylabel("Redis keys")
    ax2.legend(loc="upper left", fontsize=8)
    ax3.plot(t, [s.get("requests_served") for s in samples])
    ax3.set_ylabel("requests served")
    ax3.set_xlabel("minutes")
    for ax in (ax1, ax2, ax3):
        for kill in report["kills"]:
            ax.axvline(kill["t_s"] / 60, color="red", alpha=0.3)
    fig.suptitle(
        f"soak: {report['requests_served']} served, {report['other_errors']} errors not the client's, "
        f"{report['tokens_lost_or_duplicated']} tokens lost/duplicated; red: kill -9 of a target"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-every-s", type=float, default=600.0)
    parser.add_argument("--down-s", type=float, default=5.0, help="how long a killed replica stays down")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--target", help="target model dir (default: the tiny test pair)")
    parser.add_argument("--draft", help="draft model dir (with --target)")
    parser.add_argument("--out", default="soak-out")
    parser.add_argument("--plot-only", action="store_true", help="redraw OUT/soak.png from OUT/soak.json")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(Path(args.out) / "soak.json", Path(args.out) / "soak.png")
        return 0
    if bool(args.target) != bool(args.draft):
        parser.error("--target and --draft go together")
    report = Soak(args).run()
    summary = {k: v for k, v in report.items() if k not in ("samples", "problems")}
    print(json.dumps(summary, indent=1))
    return 0 if report["other_errors"] == 0 and report["tokens_lost_or_duplicated"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
