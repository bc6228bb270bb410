"""The grammar engine: constraints compiled against a tokenizer, and a per-session matcher (xgrammar).

The only module that imports xgrammar (docs/design.md, "Constrained decoding"). A
:class:`GrammarEngine` is built once per tokenizer (its ``TokenizerInfo``) and compiles a
:class:`~specserve.api.constraints.Constraint` into a grammar, keeping the most recent ones in an
LRU keyed by the constraint; a constraint that does not compile raises
:class:`~specserve.api.errors.InvalidArgument` with the engine's message. JSON (``json_schema``,
``json_object``) is compiled without free whitespace (``, `` and ``: `` separators), so a key, its
quotes and the punctuation around it are forced text. Two guards keep every output valid under its
schema (docs/benchmarks/constraints.md): a schema using a keyword xgrammar compiles but does not
enforce (:data:`UNENFORCED_KEYWORDS`) is refused naming it, and a length-bounded string without a
``pattern`` or ``format`` is compiled as the pattern ``^.{m,n}$`` (xgrammar's plain length-bounded
string admits raw control characters, mlc-ai/xgrammar#800).

A :class:`ConstraintMatcher` is one session's position in its grammar. It holds the generated
tokens it has consumed (:attr:`ConstraintMatcher.tokens`) and is brought to a session's committed
tokens by :meth:`ConstraintMatcher.sync` (roll back to the common prefix, accept the rest), so a
replica that never saw the session rebuilds the state from the committed tokens alone.
:meth:`ConstraintMatcher.masks_along` is the verify pass's branch: it fills the allowed-token mask
after the committed tokens and after each proposed token, then rolls back to where it was.

The end-of-sequence tokens (the engine's ``stop_token_ids``) are allowed only where the grammar is
complete; after one of them is accepted the matcher is terminated and only they are allowed.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument

#: Compiled grammars an engine keeps (least recently used dropped first).
DEFAULT_CACHE_SIZE = 256
#: JSON is compiled with these separators and no other whitespace (the keys' punctuation is forced).
JSON_SEPARATORS = (", ", ": ")

#: Keywords xgrammar accepts but does not enforce: a schema using one is refused (its output could break it).
UNENFORCED_KEYWORDS = frozenset(
    {"not", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas", "dependencies"}
    | {"if", "then", "else", "unevaluatedProperties", "unevaluatedItems", "propertyNames"}
)
#: Keywords whose value is a map of names to subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
#: Keywords whose value is a subschema or a list of them.
_SCHEMA_SLOTS = ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf", "additionalItems")

_ENGINE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _engine_message(exc: BaseException) -> str:
    """The engine's error without its timestamp and source location."""
    return _ENGINE_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


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
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of ``constraint`` (from the cache when it holds it); InvalidArgument naming
        the problem when it does not compile."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                self.stats.hits += 1
                return compiled
        start = time.perf_counter()
        try:
            compiled = self._compile(constraint)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidArgument(f"the {constraint.kind} constraint does not compile: {_engine_message(exc)}") from exc
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_s += elapsed
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        kind = constraint.kind
        if kind == "json_schema":
            schema = guard_schema(json.loads(constraint.text))
            return self._compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
            )
        if kind == "json_object":
            return self._compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
            )
        if kind == "regex":
            return self._compiler.compile_regex(constraint.text)
        if kind == "choice":
            return self._compiler.compile_grammar(choice_ebnf(constraint.choices))
        return self._compiler.compile_grammar(constraint.text, root_rule_name="root")

    def matcher(self, constraint: Constraint) -> ConstraintMatcher:
        """A fresh matcher at the start of ``constraint``'s grammar."""
        return ConstraintMatcher(self, constraint, self.compile(constraint))


def guard_schema(schema: Any, path: str = "#") -> Any:
    """``schema`` made safe for xgrammar: InvalidArgument naming a keyword it would not enforce (and where);
    a length-bounded string without ``pattern`` / ``format`` / ``enum`` / ``const`` gets the pattern
    ``^.{m,n}$``. Returns a new schema; the input is not changed."""
    if not isinstance(schema, dict):
        return schema
    for key in sorted(UNENFORCED_KEYWORDS & schema.keys()):
        raise InvalidArgument(f"json_schema keyword {key!r} at {path} is not supported (it would not be enforced)")
    if schema.get("uniqueItems") is True:
        raise InvalidArgument(f"json_schema keyword 'uniqueItems' at {path} is not supported (it would not be enforced)")
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: guard_schema(sub, f"{path}/{key}/{name}") for name, sub in out[key].items()}
    for key in _SCHEMA_SLOTS:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [guard_schema(sub, f"{path}/{key}/{i}") for i, sub in enumerate(value)]
        elif isinstance(value, dict):
            out[key] = guard_schema(value, f"{path}/{key}")
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^.{{{low},{'' if high is None else int(high)}}}$"
    return out


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose strings are exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class ConstraintMatcher:
    """One session's state in its grammar: the generated tokens consumed so far (see the module docstring)."""

    def __init__(self, engine: GrammarEngine, constraint: Constraint, compiled: xgr.CompiledGrammar) -> None:
        self.engine = engine
        self.constraint = constraint
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self._tokens: list[int] = []
        self._terminal_extra = 0  # stop tokens consumed after termination (the xgrammar matcher saw none)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The generated tokens the matcher has consumed, in order."""
        return tuple(self._tokens)

    @property
    def terminated(self) -> bool:
        """An end-of-sequence token was consumed: nothing may follow but more of them."""
        return bool(self._matcher.is_terminated())

    def accept(self, token_id: int) -> bool:
        """Consume ``token_id`` if the grammar allows it here (True), else leave the state as it was (False).

        After termination only the end-of-sequence tokens are allowed, and they change nothing.
        """
        if self._matcher.is_terminated():
            if token_id in self.engine.stop_token_ids:
                self._tokens.append(token_id)
                self._terminal_extra += 1
                return True
            return False
        if not 0 <= token_id < self.engine.vocab_size or not self._matcher.accept_token(int(token_id)):
            return False
        self._tokens.append(int(token_id))
        return True

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` consumed tokens."""
        if not 0 <= count <= len(self._tokens):
            raise ValueError(f"cannot roll back {count} of {len(self._tokens)} tokens")
        extra = min(count, self._terminal_extra)
        self._terminal_extra -= extra
        if count - extra:
            self._matcher.rollback(count - extra)
        del self._tokens[len(self._tokens) - count :]

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

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (xgrammar's packed int32 layout)."""
        if self._matcher.is_terminated():
            bitmask[row] = 0
            for t in self.engine.stop_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

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
        return xgr.allocate_token_bitmask(rows, self.engine.vocab_size)

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
        if self._matcher.is_terminated():
            return True
        bitmask = self.allocate(1)
        self.fill_mask(bitmask, 0)
        allowed = unpack(bitmask, self.engine.vocab_size)[0]
        stops = list(self.engine.stop_token_ids)
        return int(allowed.sum()) == len(stops) and bool(allowed[stops].all())

    def forced_text(self) -> str:
        """The longest text every continuation of the grammar starts with here ("" when there is a choice)."""
        if self._matcher.is_terminated():
            return ""
        return str(self._matcher.find_jump_forward_string())


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


class SessionGrammars:
    """A worker's matchers, one per constrained session (most recently used kept), over one lazily built
    engine. A matcher is a cache like a KV cache: :meth:`at` brings it to the session's committed tokens
    before every use, and one that was dropped (evicted, released, never seen) is rebuilt from them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], *, max_sessions: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._engine: GrammarEngine | None = None
        self._matchers: OrderedDict[str, ConstraintMatcher] = OrderedDict()
        self.max_sessions = max_sessions

    @property
    def engine(self) -> GrammarEngine:
        """The engine (built on first use: the tokenizer's table is read once)."""
        if self._engine is None:
            self._engine = GrammarEngine(self._tokenizer, self._vocab_size, self._stop_token_ids)
        return self._engine

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._matchers

    def at(self, session_id: str, constraint: Constraint, generated: Sequence[int]) -> ConstraintMatcher:
        """The session's matcher brought to ``generated`` (its committed tokens after the prompt).

        InvalidArgument when the constraint does not compile or the tokens break it (then the matcher is
        dropped, to be rebuilt next time).
        """
        matcher = self._matchers.get(session_id)
        if matcher is None or matcher.constraint != constraint:
            matcher = self.engine.matcher(constraint)
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

    def held(self, session_id: str) -> tuple[int, ...] | None:
        """The generated tokens the session's matcher holds (None: no matcher)."""
        matcher = self._matchers.get(session_id)
        return matcher.tokens if matcher is not None else None

    def drop(self, session_id: str) -> None:
        """Forget the session's matcher (rebuilt from the committed tokens if it is used again)."""
        self._matchers.pop(session_id, None)
