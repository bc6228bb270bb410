"""The grammar engine: constraints compiled against a tokenizer, and a per-session matcher (llguidance).

The only module that imports the engine, llguidance (docs/design.md, "Constrained decoding"; the
choice between it and xgrammar: docs/benchmarks/constraints.md). A :class:`GrammarEngine` is built
once per tokenizer (its ``LLTokenizer``) and compiles a :class:`~specserve.api.constraints.Constraint`
into a grammar, keeping the most recent ones in an LRU keyed by the constraint; a constraint that does
not compile, or uses a JSON Schema keyword the engine cannot enforce, raises
:class:`~specserve.api.errors.InvalidArgument` with the engine's message. JSON (``json_schema``,
``json_object``) is compiled without free whitespace (``, `` and ``: `` separators), so a key, its
quotes and the punctuation around it are forced text. A ``grammar`` is GBNF (llama.cpp's EBNF, start
rule ``root``), converted to Lark by llguidance; a ``choice`` is a Lark alternation of its strings.

Every compile is bounded by :data:`PARSER_LIMITS`, llguidance's own limits on its lexer's and its
grammar's work (a grammar past one does not compile: InvalidArgument naming the limit). They do not
meter all of it (the JSON compiler proves ``patternProperties`` disjoint pair by pair), so compiles
run on threads of their own, and the callers bound who waits for them (the coordinator's
``ConstraintCompiler``; a worker compiles only constraints the coordinator compiled).

A worker compiles a constraint it has not seen before the batch pass that needs it
(:meth:`SessionGrammars.prepare`, awaited on the event loop: the compile runs on a thread of its own,
outside the model thread and the worker's batch lock, at the lowest CPU priority; llguidance releases
the GIL while it compiles), so a schema that takes seconds delays only its own session. ``prepare``
returns the compiled grammars, and the pass holds them (:meth:`SessionGrammars.at` takes one): the
pass never compiles, whatever the cache evicted meanwhile.

A :class:`ConstraintMatcher` is one session's position in its grammar. It holds the generated
tokens it has consumed (:attr:`ConstraintMatcher.tokens`) and is brought to a session's committed
tokens by :meth:`ConstraintMatcher.sync` (roll back to the common prefix, accept the rest), so a
replica that never saw the session rebuilds the state from the committed tokens alone.
:meth:`ConstraintMatcher.masks_along` is the verify pass's branch: it fills the allowed-token mask
after the committed tokens and after each proposed token, then rolls back to where it was.

The end-of-sequence tokens (the engine's ``stop_token_ids``) are allowed only where the grammar is
complete; after one of them is accepted the matcher is terminated and only they are allowed. Masks
use the packed layout both engines share: ``[rows, ceil(vocab / 32)]`` int32, bit ``i`` of word ``w``
allowing token ``32 w + i``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark

from specserve.api.constraints import Constraint
from specserve.api.errors import Aborted, InvalidArgument

#: Compiled grammars an engine keeps (least recently used dropped first).
DEFAULT_CACHE_SIZE = 256
#: Threads a worker compiles new constraints on (:meth:`SessionGrammars.prepare`), and their nice value:
#: the lowest priority, so a slow compile takes CPU from the model threads' passes only when they leave some.
PREPARE_THREADS = 2
PREPARE_NICE = 19
#: llguidance's limits on a compile's and a mask's work, set explicitly (its documented defaults, which fit
#: :data:`~specserve.api.constraints.MAX_CONSTRAINT_BYTES` of grammar text), with its errors kept short
#: (``verbose_errors``: no parser state in a message that goes back to a client or a log).
PARSER_LIMITS = {
    "max_items_in_row": 2_000,  # branching of one grammar row
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes at compile (about 20 ms)
    "step_lexer_fuel": 200_000,  # the lexer's work per mask (about 15 ms)
    "step_max_items": 50_000,  # Earley items per mask (about 2.5 ms)
    "max_lexer_states": 250_000,  # lexer states, 1-2 kB each
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "verbose_errors": False,
}
#: JSON is compiled with these separators and no other whitespace (the keys' punctuation is forced).
JSON_SEPARATORS = (", ", ": ")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _engine_message(text: str) -> str:
    """The engine's error on one line, without its source excerpt (the numbered lines and the caret)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    kept = [line for line in lines if line and not set(line) <= {"^", " "} and not re.match(r"^\d+ \|", line)]
    return " ".join(kept) or "unknown error"


@dataclass
class CompileStats:
    """What an engine's compile cache did: hits, misses (compiles) and the seconds compiling took."""

    hits: int = 0
    misses: int = 0
    compile_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class GrammarEngine:
    """Compiles constraints for one tokenizer and vocabulary size (the model's logits width).

    ``stop_token_ids``: the model's end-of-sequence ids, the tokens the grammar allows only where it
    is complete. Thread-safe: compiles may run off the event loop while matchers run elsewhere.
    ``max_threads`` is accepted for the callers' sake; llguidance compiles on the calling thread.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_threads: int = 1,
    ) -> None:
        stops = sorted(set(int(t) for t in stop_token_ids))
        if not stops:
            raise ValueError("a grammar engine needs at least one end-of-sequence token id")
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(stops)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=stops)
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar of ``constraint`` (a matcher at its start; from the cache when it holds it);
        InvalidArgument naming the problem when it does not compile. Slow at worst: call it off the event
        loop and outside any lock a pass holds."""
        compiled = self.cached(constraint)
        if compiled is not None:
            return compiled
        start = time.perf_counter()
        compiled = llguidance.LLMatcher(self.tokenizer, grammar_text(constraint), log_level=0, limits=self._limits)
        if compiled.is_error():
            raise InvalidArgument(
                f"the {constraint.kind} constraint does not compile: {_engine_message(compiled.get_error())}"
            )
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_s += elapsed
            if self._cache_size > 0:
                self._cache[constraint] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return compiled

    def cached(self, constraint: Constraint) -> Any | None:
        """The compiled grammar of ``constraint`` when the cache holds it (then the most recent), else None:
        a look-up, never a compile."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                self.stats.hits += 1
            return compiled

    def holds(self, constraint: Constraint) -> bool:
        """Whether the cache holds ``constraint`` compiled (a :meth:`compile` of it is then a look-up);
        touches neither the order nor the statistics."""
        with self._lock:
            return constraint in self._cache

    def matcher(self, constraint: Constraint, compiled: Any = None) -> ConstraintMatcher:
        """A fresh matcher at the start of ``constraint``'s grammar: ``compiled`` (its compiled grammar, which
        the caller holds), else compiled here (:meth:`compile`)."""
        return ConstraintMatcher(self, constraint, self.compile(constraint) if compiled is None else compiled)

    def copy(self, compiled: Any) -> Any:
        """A matcher of its own at the start of a compiled grammar (the cached one is never advanced)."""
        with self._lock:
            return compiled.deep_copy()


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; InvalidArgument for a GBNF grammar that does not convert."""
    kind = constraint.kind
    if kind == "json_schema":
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(constraint.text, overrides=_JSON_OPTIONS))  # type: ignore[arg-type]
        except ValueError as exc:  # the engine's reader: its nesting limit, a document it cannot read
            raise InvalidArgument(
                f"the json_schema constraint does not compile: {_engine_message(str(exc))}"
                + (" (the schema is nested too deeply)" if "recursion limit" in str(exc) else "")
            ) from exc
    if kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS))  # type: ignore[arg-type]
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(constraint.text))
    if kind == "choice":
        return str(llguidance.LLMatcher.grammar_from_lark(choice_lark(constraint.choices)))
    try:
        lark = any_to_lark(constraint.text)
    except RecursionError as exc:
        raise InvalidArgument("the grammar constraint does not compile: it is nested too deeply") from exc
    except Exception as exc:  # the converter raises its own errors and plain Exception
        raise InvalidArgument(f"the grammar constraint does not compile: {_engine_message(str(exc))}") from exc
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def choice_lark(choices: Sequence[str]) -> str:
    """A Lark grammar whose strings are exactly ``choices`` (JSON string escapes are Lark's too)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class ConstraintMatcher:
    """One session's state in its grammar: the generated tokens consumed so far (see the module docstring)."""

    def __init__(self, engine: GrammarEngine, constraint: Constraint, compiled: Any) -> None:
        self.engine = engine
        self.constraint = constraint
        self._matcher = engine.copy(compiled)
        self._stops = frozenset(engine.stop_token_ids)
        self._tokens: list[int] = []
        self._fed = 0  # tokens fed to the engine's matcher (the end-of-sequence tokens are kept here only)
        self._terminated_at: int | None = None  # index in _tokens of the first end-of-sequence token

    @property
    def tokens(self) -> tuple[int, ...]:
        """The generated tokens the matcher has consumed, in order."""
        return tuple(self._tokens)

    @property
    def terminated(self) -> bool:
        """An end-of-sequence token was consumed: nothing may follow but more of them."""
        return self._terminated_at is not None

    def accept(self, token_id: int) -> bool:
        """Consume ``token_id`` if the grammar allows it here (True), else leave the state as it was (False).

        An end-of-sequence token is allowed where the grammar is complete; after it only they are.
        """
        token_id = int(token_id)
        if not 0 <= token_id < self.engine.vocab_size:
            return False
        if token_id in self._stops:
            if self._terminated_at is None:
                if not self._complete():
                    return False
                self._terminated_at = len(self._tokens)
            self._tokens.append(token_id)
            return True
        if self._terminated_at is not None or self._matcher.validate_tokens([token_id]) != 1:
            return False
        if not self._matcher.consume_token(token_id):  # validated: only an engine fault gets here
            raise RuntimeError(f"the grammar engine refused a validated token: {self._matcher.get_error()}")
        self._tokens.append(token_id)
        self._fed += 1
        return True

    def _complete(self) -> bool:
        return bool(self._matcher.is_accepting()) and not self._matcher.is_error()

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` consumed tokens."""
        if not 0 <= count <= len(self._tokens):
            raise ValueError(f"cannot roll back {count} of {len(self._tokens)} tokens")
        keep = len(self._tokens) - count
        if self._terminated_at is not None and keep <= self._terminated_at:
            self._terminated_at = None
        fed = min(self._fed, keep)
        if self._fed > fed and not self._matcher.rollback(self._fed - fed):
            self._matcher.reset()  # the engine could not step back: replay the tokens kept
            fed_tokens = [t for t in self._tokens[:keep] if t not in self._stops]
            self._matcher.consume_tokens(fed_tokens)
        self._fed = fed
        del self._tokens[keep:]

    def sync(self, generated: Sequence[int]) -> None:
        """Bring the state to exactly ``generated`` (a session's committed tokens after its prompt): roll
        back to the common prefix, then consume the rest. InvalidArgument when a token breaks the grammar
        (the state is then at the tokens before it)."""
        keep = 0
        limit = min(len(self._tokens), len(generated))
        while keep < limit and self._tokens[keep] == generated[keep]:
            keep += 1
        self.rollback(len(self._tokens) - keep)
        for i in range(keep, len(generated)):
            if not self.accept(int(generated[i])):
                raise InvalidArgument(
                    f"generated token {i} (id {int(generated[i])}) does not satisfy the {self.constraint.kind} "
                    "constraint"
                )

    def fill_mask(self, bitmask: Any, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (the packed int32 layout; a torch tensor or
        a numpy array on the CPU)."""
        if self._terminated_at is None:
            target = bitmask[row]
            pointer = target.data_ptr() if isinstance(target, torch.Tensor) else target.ctypes.data
            self._matcher.unsafe_compute_mask_ptr(pointer, int(target.shape[-1]) * 4)
            complete = self._complete()
        else:
            bitmask[row] = 0
            complete = True
        for t in self.engine.stop_token_ids:  # the ends: exactly where the grammar is complete
            if complete:
                bitmask[row, t // 32] |= _bit(t % 32)
            else:
                bitmask[row, t // 32] &= ~_bit(t % 32)

    def masks_along(self, proposal: Sequence[int]) -> torch.Tensor:
        """The packed allowed-token masks after the consumed tokens and after each of ``proposal``'s:
        ``[len(proposal) + 1, words]`` int32. A row after a token the grammar refuses allows every token
        (no acceptance rule reaches it: that token has probability 0). The state is left unchanged."""
        bitmask = self.allocate(len(proposal) + 1)  # [gamma + 1, words]
        bitmask.fill_(-1)
        accepted = 0
        self.fill_mask(bitmask, 0)
        for i, token in enumerate(proposal):
            if not self.accept(int(token)):
                break
            accepted += 1
            self.fill_mask(bitmask, i + 1)
        self.rollback(accepted)
        return bitmask

    def allocate(self, rows: int) -> torch.Tensor:
        """An all-zero packed mask of ``rows`` rows for this vocabulary: ``[rows, words]`` int32."""
        return torch.zeros((rows, (self.engine.vocab_size + 31) // 32), dtype=torch.int32)

    def forced_tokens(self, encode: Callable[[str], Sequence[int]]) -> tuple[int, ...]:
        """The forced continuation as tokens: ``encode`` of :meth:`forced_text` (as the target would most
        likely tokenise it), cut before the first token the grammar refuses, then an end-of-sequence token
        when that is all the grammar allows after it; nothing once terminated. The state is left unchanged."""
        if self.terminated:
            return ()
        text = self.forced_text()
        tokens = [int(t) for t in encode(text)] if text else []
        kept = 0
        for token in tokens:
            if not self.accept(token):
                break
            kept += 1
        out = tokens[:kept]
        if kept == len(tokens) and self.only_stops_allowed():
            out.append(self.engine.stop_token_ids[0])
        self.rollback(kept)
        return tuple(out)

    def only_stops_allowed(self) -> bool:
        """Whether the grammar is complete here and allows nothing but an end-of-sequence token."""
        if self.terminated:
            return True
        return self._complete() and bool(self._matcher.is_stopped())

    def forced_text(self) -> str:
        """The longest text every continuation of the grammar starts with here ("" when there is a choice);
        whole UTF-8 characters only."""
        if self.terminated or self._matcher.is_error():
            return ""
        forced = bytes(self._matcher.compute_ff_bytes())
        try:
            return forced.decode("utf-8")
        except UnicodeDecodeError as exc:  # a character cut at either end: keep the whole ones before it
            return forced[: exc.start].decode("utf-8") if exc.start > 0 else ""


def lowest_thread_priority() -> None:
    """Give the calling thread the nice value :data:`PREPARE_NICE` (Linux: per thread; elsewhere, or where
    it is refused, the thread keeps its priority)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARE_NICE)


def _bit(index: int) -> int:
    """Bit ``index`` of a packed int32 word, as a signed int32 value."""
    value = 1 << index
    return value - (1 << 32) if value >= 1 << 31 else value


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``, any float dtype and device) with every token a mask row forbids set
    to -inf, in place; ``bitmask`` is ``[rows, words]`` int32 on the CPU."""
    if logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {bitmask.shape[0]} mask rows")
    allowed = unpack(bitmask, logits.shape[-1]).to(logits.device)  # [rows, vocab] bool
    return logits.masked_fill_(~allowed, float("-inf"))


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The packed int32 mask as booleans: ``[rows, words]`` -> ``[rows, vocab_size]`` (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class GrammarLogitsProcessor:
    """A Hugging Face ``generate()`` logits processor masking with the same engine: target-alone constrained
    decoding, the reference the service's output is compared with (one sequence, batch size 1)."""

    def __init__(self, engine: GrammarEngine, constraint: Constraint, prompt_len: int) -> None:
        self.matcher = engine.matcher(constraint)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # input_ids: [1, seq]; scores: [1, vocab]
        self.matcher.sync([int(t) for t in input_ids[0, self.prompt_len :]])
        bitmask = self.matcher.allocate(1)
        self.matcher.fill_mask(bitmask, 0)
        return apply_masks(scores.clone(), bitmask)


#: What :meth:`SessionGrammars.prepare` returns: each constraint's compiled grammar, or why it does not compile.
Prepared = dict[Constraint, Any]


class SessionGrammars:
    """A worker's matchers, one per constrained session (most recently used kept), over one lazily built
    engine (the process's one cache of compiled grammars). A matcher is a cache like a KV cache: :meth:`at`
    brings it to the session's committed tokens before every use, and one that was dropped (evicted,
    released, never seen) is rebuilt from them and the compiled grammar :meth:`prepare` gave the caller."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        max_sessions: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._cache_size = cache_size
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._engine: GrammarEngine | None = None
        self._engine_lock = threading.Lock()  # built on a preparing thread or on the model thread
        self._matchers: OrderedDict[str, ConstraintMatcher] = OrderedDict()
        self.max_sessions = max_sessions
        #: Compiles :meth:`prepare` started and that have not finished, by constraint (event loop only).
        self._preparing: dict[Constraint, asyncio.Future[Any]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # started at the first prepare

    @property
    def engine(self) -> GrammarEngine:
        """The engine (built on first use: the tokenizer's table is read once)."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = GrammarEngine(
                    self._tokenizer, self._vocab_size, self._stop_token_ids, cache_size=self._cache_size
                )
            return self._engine

    def ready(self, constraint: Constraint) -> bool:
        """Whether :meth:`at` would find ``constraint`` compiled (no compile on the caller's thread)."""
        return self._engine is not None and self._engine.holds(constraint)

    async def prepare(self, constraints: Iterable[Constraint]) -> Prepared:
        """Each of ``constraints`` compiled: from the engine's cache, else on a thread of its own
        (concurrently, one compile per constraint however many callers wait on it); returns when all are
        done, each constraint's compiled grammar or the InvalidArgument saying why it does not compile.

        Called on the event loop before a batch that needs them joins the model thread; the caller hands
        the pass what it returned (:meth:`at`), so a slow compile delays only the callers that wait for
        it and the pass never compiles, whatever the cache evicted meanwhile. A constraint that does not
        compile is the error of its items alone."""
        prepared: Prepared = {}
        waits: dict[Constraint, asyncio.Future[Any]] = {}
        for c in dict.fromkeys(constraints):
            compiled = self._engine.cached(c) if self._engine is not None else None
            if compiled is not None:
                prepared[c] = compiled
            else:
                waits[c] = self._prepare_one(c)
        if waits:
            prepared.update(zip(waits, await asyncio.gather(*waits.values()), strict=True))
        return prepared

    def _prepare_one(self, constraint: Constraint) -> asyncio.Future[Any]:
        future = self._preparing.get(constraint)
        if future is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    PREPARE_THREADS, thread_name_prefix="grammar-prepare", initializer=lowest_thread_priority
                )
            loop = asyncio.get_running_loop()
            compiling = loop.run_in_executor(self._pool, self._compile_quietly, constraint)
            future = asyncio.ensure_future(compiling)
            self._preparing[constraint] = future
            future.add_done_callback(lambda _f: self._preparing.pop(constraint, None))
        return asyncio.shield(future)  # a cancelled caller leaves the compile running for the others

    def _compile_quietly(self, constraint: Constraint) -> Any:
        """The compiled grammar, or the InvalidArgument saying why there is none (raised for its items)."""
        try:
            return self.engine.compile(constraint)
        except InvalidArgument as exc:
            return exc

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._matchers

    def at(
        self, session_id: str, constraint: Constraint, generated: Sequence[int], compiled: Any = None
    ) -> ConstraintMatcher:
        """The session's matcher brought to ``generated`` (its committed tokens after the prompt); one that is
        missing is built from ``compiled`` (what :meth:`prepare` returned for ``constraint``), else from
        the engine's cache. Nothing is compiled here: this runs in a batch pass.

        InvalidArgument when the constraint does not compile or the tokens break it (then the matcher is
        dropped, to be rebuilt next time); Aborted when the grammar was neither prepared nor cached (the
        item is tried again, and its next call prepares it).
        """
        matcher = self._matchers.get(session_id)
        if matcher is None or matcher.constraint != constraint:
            if compiled is None and self._engine is not None:
                compiled = self._engine.cached(constraint)
            if isinstance(compiled, InvalidArgument):
                raise InvalidArgument(compiled.message)
            if compiled is None:
                raise Aborted(
                    f"session {session_id!r}: its {constraint.kind} constraint was not compiled before the pass; "
                    "it is compiled for the next call"
                )
            matcher = ConstraintMatcher(self.engine, constraint, compiled)
            self._matchers[session_id] = matcher
        self._matchers.move_to_end(session_id)
        while len(self._matchers) > self.max_sessions:
            self._matchers.popitem(last=False)
        try:
            matcher.sync(generated)
        except InvalidArgument:
            self._matchers.pop(session_id, None)
            raise
        return matcher

    def close(self) -> None:
        """Stop the preparing threads (a compile running finishes in the background)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def held(self, session_id: str) -> tuple[int, ...] | None:
        """The generated tokens the session's matcher holds (None: no matcher)."""
        matcher = self._matchers.get(session_id)
        return matcher.tokens if matcher is not None else None

    def drop(self, session_id: str) -> None:
        """Forget the session's matcher (rebuilt from the committed tokens if it is used again)."""
        self._matchers.pop(session_id, None)
