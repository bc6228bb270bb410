"""The constraint engines compared: xgrammar and llguidance on the validity set, for one tokenizer.

Run (one run, one machine; docs/benchmarks/constraints.md comes from it)::

    python -m benchmarks constraints --out docs/benchmarks

For each engine, each constraint of the validity set (``--set``, by default
``tests/data/constraints``: JSON schemas, regexes and choice lists, each with a
valid example) and the tokenizer of ``--target``:

* **compile**: a cold compile of the constraint into something a matcher runs
  (xgrammar: ``GrammarCompiler.compile_*`` with its cache off; llguidance: the
  grammar and its ``LLMatcher``), median of ``--repeats``;
* **first mask**: the first next-token bitmask after the compile (where an
  engine defers work to its first mask, it shows here);
* **mask per token**: the next-token bitmask filled at every position of the
  example's tokenization (``tokenizer.encode``), then the token accepted; both
  engines walk the same tokens in lockstep, ``--repeats`` times; median and
  99th percentile over all positions;
* **validity**: ``--walks`` walks that pick a token uniformly among those the
  mask allows until the engine stops (at most ``--max-walk`` tokens): a stopped
  walk's text must parse as JSON (Python's ``json.loads``, which refuses raw
  control characters in strings) and validate against its schema (the
  ``jsonschema`` package), match its regex (``re.fullmatch``) or be one of its
  choices. A uniform walk reaches the corners of a grammar that a model rarely
  does, so an engine that lets an invalid output through shows up here.
  ``--byte-walks`` more walks draw among the allowed single-byte tokens (where
  there are any), which probes how an engine treats UTF-8: a walk's output is
  checked as bytes, and bytes that are not UTF-8 (an overlong form, a surrogate)
  are invalid;
* **unenforceable keywords**: schemas with ``not``, ``uniqueItems`` and the
  like (``unenforceable.json``): whether the engine refuses the schema, or
  compiles it and then lets outputs through that the schema rejects.

Both engines run with fixed separators (``", "`` and ``": "``, no free
whitespace), so the same token sequence walks both. A compile is timed in wall
clock (xgrammar's compiler runs ``--threads`` threads), a mask in the calling
thread's CPU time. docs/benchmarks/constraints.md holds the figures and the
choice they support.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.options import ConstraintsOptions
from specserve.bench import markdown as md
from specserve.bench.runner import Header
from specserve.bench.timing import Stopwatch

#: The validity set's files under ``--set``.
SET_FILES = {"json_schema": "json_schemas.json", "regex": "regexes.json", "choice": "choices.json"}

#: Schemas with keywords a token mask cannot or does not enforce (``--set``'s ``unenforceable.json``).
UNENFORCEABLE_FILE = "unenforceable.json"

#: How both engines write JSON: the separators ``json.dumps`` uses, no other whitespace.
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "


@dataclass(frozen=True)
class Case:
    """One constraint of the validity set: its kind, its value and a valid output."""

    kind: str  # "json_schema" | "regex" | "choice"
    name: str
    value: Any  # the schema (a dict), the pattern (a str) or the choices (a list of str)
    example: str  # a valid output, as text

    def valid(self, text: str) -> bool:
        """Whether ``text`` satisfies the constraint (JSON: parses strictly and validates)."""
        if self.kind == "regex":
            return re.fullmatch(self.value, text) is not None
        if self.kind == "choice":
            return text in self.value
        import jsonschema

        try:
            instance = json.loads(text)
        except ValueError:
            return False
        return jsonschema.Draft202012Validator(self.value).is_valid(instance)


def load_set(directory: Path) -> list[Case]:
    """The validity set in ``directory`` (tests/data/constraints), in file order."""
    cases: list[Case] = []
    for entry in json.loads((directory / SET_FILES["json_schema"]).read_text()):
        example = json.dumps(entry["example"], separators=(ITEM_SEPARATOR, KEY_SEPARATOR))
        cases.append(Case("json_schema", entry["name"], entry["schema"], example))
    for entry in json.loads((directory / SET_FILES["regex"]).read_text()):
        cases.append(Case("regex", entry["name"], entry["pattern"], entry["example"]))
    for entry in json.loads((directory / SET_FILES["choice"]).read_text()):
        cases.append(Case("choice", entry["name"], entry["choices"], max(entry["choices"], key=len)))
    return cases


class XGrammar:
    """xgrammar: a compiled grammar per constraint, a ``GrammarMatcher`` per walk."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        with Stopwatch() as sw:
            self._info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=threads, cache_enabled=False)
        self.setup_s = sw.seconds
        self.version = xgrammar.__version__ if hasattr(xgrammar, "__version__") else _version("xgrammar")

    def compile(self, case: Case) -> Any:
        if case.kind == "json_schema":
            return self._compiler.compile_json_schema(
                json.dumps(case.value), any_whitespace=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR)
            )
        if case.kind == "regex":
            return self._compiler.compile_regex(case.value)
        ebnf = "root ::= " + " | ".join(json.dumps(choice) for choice in case.value)
        return self._compiler.compile_grammar(ebnf)

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def stopped(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class LLGuidance:
    """llguidance: a grammar string per constraint, an ``LLMatcher`` per walk (its compile is the matcher's)."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        with Stopwatch() as sw:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_s = sw.seconds
        self.version = _version("llguidance")

    def grammar(self, case: Case) -> str:
        from llguidance import LLMatcher

        if case.kind == "json_schema":
            options = {
                "whitespace_flexible": False,
                "item_separator": ITEM_SEPARATOR,
                "key_separator": KEY_SEPARATOR,
            }
            return LLMatcher.grammar_from_json_schema(case.value, overrides=options)  # type: ignore[arg-type]
        if case.kind == "regex":
            return LLMatcher.grammar_from_regex(case.value)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in case.value))

    def compile(self, case: Case) -> Any:
        matcher = self._llg.LLMatcher(self._tokenizer, self.grammar(case))
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        row = bitmask[0]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def stopped(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


class Shipped:
    """What specserve ships (``specserve.engine.grammar.GrammarEngine``): xgrammar behind its guards, timed
    without its cache."""

    name = "specserve"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        from specserve.engine.grammar import GrammarEngine

        with Stopwatch() as sw:
            eos = tokenizer.eos_token_id
            self._engine = GrammarEngine(tokenizer, vocab_size, [eos], cache_size=0, max_threads=threads)
        self.setup_s = sw.seconds
        self.version = "xgrammar " + _version("xgrammar") + " + specserve.engine.grammar"

    def compile(self, case: Case) -> Any:
        from specserve.api.constraints import Constraint

        if case.kind == "json_schema":
            constraint = Constraint("json_schema", json.dumps(case.value))
        elif case.kind == "regex":
            constraint = Constraint("regex", case.value)
        else:
            constraint = Constraint("choice", tuple(case.value))
        return constraint, self._engine.compile(constraint)

    def matcher(self, compiled: Any) -> Any:
        from specserve.engine.grammar import ConstraintMatcher

        constraint, grammar = compiled
        return ConstraintMatcher(self._engine, constraint, grammar)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.fill_mask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept(token))

    def stopped(self, matcher: Any) -> bool:
        return bool(matcher.terminated)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _allowed(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a ``[1, ceil(vocab / 32)]`` int32 bitmask allows (bit i of word w: token 32 w + i)."""
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def _timed(fn, *args, clock=time.perf_counter_ns) -> tuple[Any, float]:
    with Stopwatch(clock) as sw:
        result = fn(*args)
    return result, sw.seconds


def _cpu_timed(fn, *args) -> tuple[Any, float]:
    """``_timed`` in the calling thread's CPU time: what a mask costs, little moved by other processes."""
    return _timed(fn, *args, clock=time.thread_time_ns)


def measure_case(
    engines: list, case: Case, tokenizer, vocab: Vocabulary, vocab_size: int, args, rng: random.Random
) -> dict:
    """One constraint on every engine: compile, first mask, mask per token along the example, walks."""
    words = (vocab_size + 31) // 32
    tokens = tokenizer.encode(case.example, add_special_tokens=False)
    row: dict[str, Any] = {"kind": case.kind, "name": case.name, "example_tokens": len(tokens)}
    compiled: dict[str, Any] = {}
    for engine in engines:
        result: dict[str, Any] = {}
        try:
            compile_s, first_s = [], []
            for _ in range(args.repeats):
                grammar, seconds = _timed(engine.compile, case)
                compile_s.append(seconds)
                bitmask = np.zeros((1, words), dtype=np.int32)
                matcher = engine.matcher(grammar)
                first_s.append(_cpu_timed(engine.fill, matcher, bitmask)[1])
            compiled[engine.name] = grammar
            result["compile_ms"] = 1e3 * statistics.median(compile_s)
            result["first_mask_ms"] = 1e3 * statistics.median(first_s)
        except Exception as exc:  # an engine that cannot compile a constraint is a result, not a crash
            result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row[engine.name] = result
    ready = [engine for engine in engines if engine.name in compiled]
    per_token: dict[str, list[float]] = {engine.name: [] for engine in ready}
    for _ in range(args.repeats):
        matchers = {engine.name: engine.matcher(compiled[engine.name]) for engine in ready}
        bitmask = np.zeros((1, words), dtype=np.int32)
        for token in tokens:
            for engine in ready:
                per_token[engine.name].append(_cpu_timed(engine.fill, matchers[engine.name], bitmask)[1])
                if not engine.accept(matchers[engine.name], token):
                    row[engine.name]["example_refused"] = True
    for engine in ready:
        times = sorted(per_token[engine.name])
        result = row[engine.name]
        if times:
            result["mask_us_median"] = 1e6 * statistics.median(times)
            result["mask_us_mean"] = 1e6 * statistics.fmean(times)
            result["mask_us_p99"] = 1e6 * times[min(len(times) - 1, int(0.99 * len(times)))]
        result.update(_walks(engine, compiled[engine.name], case, vocab, vocab_size, args, rng))
    return row


class Vocabulary:
    """The tokenizer's exact bytes per token (llguidance's table), to check a walk's output as bytes."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance.hf

        self._table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._special = set(tokenizer.all_special_ids)
        lengths = [
            len(self._table.decode_bytes([t])) if t not in self._special else 0 for t in range(vocab_size)
        ]
        #: Tokens of exactly one byte: a byte walk draws among these where the mask allows any.
        self.single_byte = np.array([n == 1 for n in lengths])

    def text(self, tokens: list[int]) -> str | None:
        """The tokens' bytes (special tokens left out) as UTF-8 text; None when they are not UTF-8."""
        try:
            return self._table.decode_bytes([t for t in tokens if t not in self._special]).decode("utf-8")
        except UnicodeDecodeError:
            return None


def _walks(
    engine, compiled: Any, case: Case, vocab: Vocabulary, vocab_size: int, args, rng: random.Random
) -> dict:
    """Walks under the mask: ``args.walks`` drawing uniformly among the allowed tokens, ``args.byte_walks``
    among the allowed single-byte tokens where there are any (they probe how the engine treats UTF-8);
    how many stopped, and how many of those are valid (UTF-8, and valid under the constraint)."""
    words = (vocab_size + 31) // 32
    result: dict[str, Any] = {"invalid_examples": []}
    for kind, count in (("", args.walks), ("byte_", args.byte_walks)):
        stopped = valid = not_utf8 = 0
        for _ in range(count):
            matcher = engine.matcher(compiled)
            bitmask = np.zeros((1, words), dtype=np.int32)
            out: list[int] = []
            for _ in range(args.max_walk):
                if engine.stopped(matcher):
                    break
                engine.fill(matcher, bitmask)
                allowed = _allowed(bitmask, vocab_size)
                if kind and vocab.single_byte[allowed].any():
                    allowed = allowed[vocab.single_byte[allowed]]
                if len(allowed) == 0:
                    break
                token = int(allowed[rng.randrange(len(allowed))])
                if not engine.accept(matcher, token):
                    break
                out.append(token)
            if not engine.stopped(matcher):
                continue
            stopped += 1
            text = vocab.text(out)
            not_utf8 += text is None
            if text is not None and case.valid(text):
                valid += 1
            elif len(result["invalid_examples"]) < 2:
                shown = text if text is not None else repr(vocab._table.decode_bytes(out))
                result["invalid_examples"].append(("not UTF-8: " if text is None else "") + shown[:160])
        result.update(
            {
                f"{kind}walks": count,
                f"{kind}stopped": stopped,
                f"{kind}valid": valid,
                f"{kind}not_utf8": not_utf8,
            }
        )
    return result


def measure(args: ConstraintsOptions) -> dict:
    from transformers import AutoTokenizer

    from specserve.engine.models import resolve_model_path

    path = resolve_model_path(args.target, "target")
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = args.vocab_size or len(tokenizer)
    engines = [
        XGrammar(tokenizer, vocab_size, args.threads),
        LLGuidance(tokenizer, vocab_size, args.threads),
        Shipped(tokenizer, vocab_size, args.threads),
    ]
    vocab = Vocabulary(tokenizer, vocab_size)
    cases = load_set(Path(args.set))
    rng = random.Random(args.seed)
    unenforceable = [
        Case("json_schema", entry["name"], entry["schema"], "")
        for entry in json.loads((Path(args.set) / UNENFORCEABLE_FILE).read_text())
    ]
    refusals = []
    for case in unenforceable:
        row: dict[str, Any] = {"name": case.name, "schema": case.value}
        for engine in engines:
            try:
                grammar = engine.compile(case)
            except Exception as exc:
                row[engine.name] = {"refused": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
                continue
            row[engine.name] = _walks(engine, grammar, case, vocab, vocab_size, args, rng)
        refusals.append(row)
    rows = []
    for case in cases:
        rows.append(measure_case(engines, case, tokenizer, vocab, vocab_size, args, rng))
        print(
            f"{case.kind:12s} {case.name:28s} "
            + "  ".join(
                f"{e.name} {rows[-1][e.name].get('compile_ms', float('nan')):.1f} ms "
                f"{rows[-1][e.name].get('mask_us_median', float('nan')):.0f} us "
                f"{rows[-1][e.name].get('valid', 0)}/{rows[-1][e.name].get('stopped', 0)}"
                for e in engines
            ),
            file=sys.stderr,
        )
    return {
        **Header.of(args).to_json(),
        "vocab_size": vocab_size,
        "repeats": args.repeats,
        "walks": args.walks,
        "byte_walks": args.byte_walks,
        "max_walk": args.max_walk,
        "engines": {e.name: {"version": e.version, "tokenizer_setup_ms": 1e3 * e.setup_s} for e in engines},
        "cases": rows,
        "unenforceable": refusals,
    }


def _summary(data: dict, engine: str, kind: str | None = None) -> dict[str, float]:
    rows = [r[engine] for r in data["cases"] if kind is None or r["kind"] == kind]
    ok = [r for r in rows if "error" not in r]
    return {
        "cases": len(rows),
        "errors": len(rows) - len(ok),
        "compile_ms_median": statistics.median(r["compile_ms"] for r in ok) if ok else float("nan"),
        "compile_ms_max": max((r["compile_ms"] for r in ok), default=float("nan")),
        "first_mask_ms_median": statistics.median(r["first_mask_ms"] for r in ok) if ok else float("nan"),
        "mask_us_median": statistics.median(r["mask_us_median"] for r in ok if "mask_us_median" in r)
        if ok
        else float("nan"),
        "mask_us_mean": statistics.fmean(r["mask_us_mean"] for r in ok if "mask_us_mean" in r)
        if ok
        else float("nan"),
        "mask_us_p99_max": max((r.get("mask_us_p99", 0.0) for r in ok), default=float("nan")),
        "stopped": sum(r.get("stopped", 0) for r in ok),
        "valid": sum(r.get("valid", 0) for r in ok),
        "walks": sum(r.get("walks", 0) for r in ok),
        "byte_stopped": sum(r.get("byte_stopped", 0) for r in ok),
        "byte_valid": sum(r.get("byte_valid", 0) for r in ok),
        "byte_walks": sum(r.get("byte_walks", 0) for r in ok),
        "not_utf8": sum(r.get("not_utf8", 0) + r.get("byte_not_utf8", 0) for r in ok),
        "refused_examples": sum(1 for r in ok if r.get("example_refused")),
    }


def render(data: dict) -> str:
    engines = list(data["engines"])
    lines = [
        "# Constraint engines: xgrammar and llguidance",
        "",
        f"Measured {data['date_utc']} UTC ({data['machine']['platform']}, python {data['machine']['python']}), "
        f"tokenizer of `{Path(data['target']).name}` ({data['vocab_size']} tokens); "
        + ", ".join(f"{name} {info['version']}" for name, info in data["engines"].items())
        + "; one run of:",
        "",
        *md.command_block(data["command"]),
        f"The validity set (tests/data/constraints): {sum(1 for r in data['cases'] if r['kind'] == 'json_schema')} JSON schemas, "
        f"{sum(1 for r in data['cases'] if r['kind'] == 'regex')} regexes, {sum(1 for r in data['cases'] if r['kind'] == 'choice')} choice lists. "
        f"Compile: a cold compile, median of {data['repeats']}. Mask: the next-token bitmask at each position of the "
        f"example's tokens, {data['repeats']} passes, in the thread's CPU time; median over positions, the mean of the constraints' means, and the worst constraint's 99th percentile. "
        f"Walks: {data['walks']} per constraint, each token drawn uniformly among those the mask allows, at most "
        f"{data['max_walk']} tokens; byte walks: {data.get('byte_walks', 0)} per constraint, drawn among the allowed "
        "single-byte tokens where there are any; 'valid' counts the stopped walks whose bytes are UTF-8 and whose "
        "text parses strictly and validates.",
        "",
    ]
    summaries = [
        (engine, kind, _summary(data, engine, kind)) for engine in engines for kind in (None, "json_schema", "regex", "choice")
    ]
    lines += md.table(
        ("engine", "kind", "constraints", "compile errors", "compile ms (median / max)", "first mask ms (median)",
         "mask µs per token (median / mean / worst p99)", "walks: valid of stopped of all",
         "byte walks: valid of stopped of all", "outputs not UTF-8", "examples refused"),
        ((engine, kind or "all", s["cases"], s["errors"], f"{s['compile_ms_median']:.2f} / {s['compile_ms_max']:.1f}",
          f"{s['first_mask_ms_median']:.2f}",
          f"{s['mask_us_median']:.0f} / {s['mask_us_mean']:.0f} / {s['mask_us_p99_max']:.0f}",
          f"{s['valid']} of {s['stopped']} of {s['walks']}", f"{s['byte_valid']} of {s['byte_stopped']} of {s['byte_walks']}",
          s["not_utf8"], s["refused_examples"])
         for engine, kind, s in summaries),
    )  # fmt: skip
    lines += [
        "",
        "Tokenizer setup (once per tokenizer): "
        + ", ".join(f"{name} {info['tokenizer_setup_ms']:.0f} ms" for name, info in data["engines"].items())
        + ".",
        "",
        "## Per constraint",
        "",
    ]
    rows = []
    for row in data["cases"]:
        cells = [row["kind"], row["name"], row["example_tokens"]]
        for engine in engines:
            r = row[engine]
            if "error" in r:
                cells += [f"error: {r['error'][:60]}", "", ""]
                continue
            cells += [
                f"{r['compile_ms']:.2f}",
                f"{r.get('mask_us_median', float('nan')):.0f} / {r.get('mask_us_mean', float('nan')):.0f}",
                f"{r['valid']} of {r['stopped']}, bytes {r['byte_valid']} of {r['byte_stopped']}"
                + (" (example refused)" if r.get("example_refused") else ""),
            ]
        rows.append(cells)
    header = ["kind", "name", "tokens"]
    header += [f"{e} {col}" for e in engines for col in ("compile ms", "mask µs (median / mean)", "valid")]
    lines += md.table(header, rows)
    lines += [
        "",
        "## Keywords a mask does not enforce",
        "",
        "Schemas of `unenforceable.json`: refused (the error the engine gives), or compiled and walked as above.",
        "",
    ]

    def outcome(r: dict) -> str:
        if "refused" in r:
            return "refused: " + r["refused"].replace("|", "\\|")[:90]
        return (
            f"compiled; {r['valid']} of {r['stopped']} stopped walks valid, "
            f"byte walks {r['byte_valid']} of {r['byte_stopped']}"
        )

    lines += md.table(
        ["schema", *engines],
        ([f"`{row['name']}`", *(outcome(row[engine]) for engine in engines)] for row in data.get("unenforceable", [])),
    )
    invalid = [
        (row["name"], engine, text)
        for row in data["cases"] + data.get("unenforceable", [])
        for engine in engines
        for text in row[engine].get("invalid_examples", [])
    ]
    if invalid:
        lines += ["", "Invalid outputs the walks reached (first two per constraint and engine):", ""]
        lines += [f"- {engine}, `{name}`: `{json.dumps(text)}`" for name, engine, text in invalid]
    return "\n".join(lines) + "\n"


def main(opts: ConstraintsOptions) -> int:
    """``python -m benchmarks constraints``: the report printed, and with ``--out`` written as
    ``constraint_engines.json`` and ``constraint_engines.md``."""
    data = measure(opts)
    text = render(data)
    if opts.out is not None:
        md.write(opts.out, "constraint_engines", text, data)
    print(text)
    return 0
