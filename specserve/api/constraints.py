"""Structured-output constraints as a checked domain object: JSON schema, any JSON object, regex, choice, grammar.

Pure Python (no torch, no grammar engine): the SDK, the coordinator and both workers share it.
:class:`Constraint` checks itself cheaply on construction and raises
:class:`~specserve.api.errors.InvalidArgument` naming the problem; the size limit
(:data:`MAX_CONSTRAINT_BYTES`) holds before any other work, so an oversized schema is never parsed.
Whether a constraint compiles is the engine's question (``specserve.engine.grammar``), asked later.
The wire form is ``Constraint`` in common.proto, carried inside ``SamplingParams`` (docs/design.md,
"Constrained decoding").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specserve.api.errors import InvalidArgument
from specserve.v1 import common_pb2

#: The kinds of constraint, named as the ``Constraint.kind`` oneof's fields.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
#: The most UTF-8 bytes a constraint's text may hold (a schema, a regex, a grammar, or all choices together).
MAX_CONSTRAINT_BYTES = 64 * 1024
#: The most alternatives a choice constraint may list.
MAX_CHOICES = 1024
#: The most rules (``::=``) a grammar may define: converting GBNF to the engine's Lark is Python, holding the
#: GIL, and takes time that grows as the rules times the text (about a second at this many and 64 KiB).
MAX_GRAMMAR_RULES = 256


@dataclass(frozen=True)
class Constraint:
    """What a constrained generation must produce: ``kind`` (one of :data:`CONSTRAINT_KINDS`) and ``value``.

    ``value`` is the schema's JSON text (``json_schema``), ``""`` (``json_object``), the regular
    expression (``regex``), the tuple of alternatives (``choice``), or the EBNF text in the
    GBNF dialect (llama.cpp's EBNF) with a ``root`` rule (``grammar``). Equal constraints compile to the same grammar,
    so the dataclass is the compile cache's key.
    """

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidArgument(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            if isinstance(self.value, str) or not all(isinstance(c, str) for c in self.value):
                raise InvalidArgument("a choice constraint's value must be a list of strings")
            object.__setattr__(self, "value", tuple(self.value))
        elif not isinstance(self.value, str):
            raise InvalidArgument(f"a {self.kind} constraint's value must be a string")
        size = self.size_bytes
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidArgument(
                f"the {self.kind} constraint has {size} bytes; at most {MAX_CONSTRAINT_BYTES} are accepted"
            )
        getattr(self, f"_check_{self.kind}")()

    @property
    def size_bytes(self) -> int:
        """UTF-8 bytes of the constraint's text (all alternatives together for a choice)."""
        if isinstance(self.value, tuple):
            return sum(len(c.encode("utf-8", "surrogatepass")) for c in self.value)
        return len(self.value.encode("utf-8", "surrogatepass"))

    @property
    def text(self) -> str:
        """The schema, regex or grammar text (``""`` for ``json_object``); TypeError for a choice."""
        if isinstance(self.value, tuple):
            raise TypeError("a choice constraint has choices, not text")
        return self.value

    @property
    def choices(self) -> tuple[str, ...]:
        """A choice constraint's alternatives; TypeError for another kind."""
        if not isinstance(self.value, tuple):
            raise TypeError(f"a {self.kind} constraint has text, not choices")
        return self.value

    def _check_json_schema(self) -> None:
        try:
            schema = json.loads(self.text)
        except ValueError as exc:  # json.JSONDecodeError
            raise InvalidArgument(f"json_schema is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise InvalidArgument("json_schema is nested too deeply to read") from exc
        if not isinstance(schema, dict):
            raise InvalidArgument(f"json_schema must be a JSON object, got a JSON {type(schema).__name__}")

    def _check_json_object(self) -> None:
        if self.value != "":
            raise InvalidArgument("a json_object constraint takes no value")

    def _check_regex(self) -> None:
        if not self.value:
            raise InvalidArgument("regex must not be empty")

    def _check_choice(self) -> None:
        if not self.value:
            raise InvalidArgument("choice must list at least one string")
        if len(self.value) > MAX_CHOICES:
            raise InvalidArgument(f"choice lists {len(self.value)} strings; at most {MAX_CHOICES} are accepted")
        if any(c == "" for c in self.value):
            raise InvalidArgument("choice must not contain the empty string")

    def _check_grammar(self) -> None:
        if not self.text.strip():
            raise InvalidArgument("grammar must not be empty (EBNF with a root rule)")
        rules = self.text.count("::=")
        if rules > MAX_GRAMMAR_RULES:
            raise InvalidArgument(f"grammar defines {rules} rules ('::='); at most {MAX_GRAMMAR_RULES} rules are accepted")

    @classmethod
    def from_pb(cls, pb: common_pb2.Constraint) -> Constraint | None:
        """The constraint a wire message holds; None when no kind is set."""
        kind = pb.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "json_object":
            if not pb.json_object:
                raise InvalidArgument("json_object must be true when set")
            return cls("json_object")
        if kind == "choice":
            return cls("choice", tuple(pb.choice.choices))
        return cls(kind, getattr(pb, kind))

    def to_pb(self) -> common_pb2.Constraint:
        if self.kind == "json_object":
            return common_pb2.Constraint(json_object=True)
        if self.kind == "choice":
            return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=list(self.choices)))
        if self.kind == "json_schema":
            return common_pb2.Constraint(json_schema=self.text)
        if self.kind == "regex":
            return common_pb2.Constraint(regex=self.text)
        return common_pb2.Constraint(grammar=self.text)

    @classmethod
    def from_dict(cls, data: dict) -> Constraint:
        """From ``dataclasses.asdict`` of one (the JSON form a store records)."""
        value = data.get("value", "")
        return cls(str(data["kind"]), tuple(value) if isinstance(value, list) else value)
