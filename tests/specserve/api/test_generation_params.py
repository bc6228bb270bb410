"""``GenerationParams`` is the one definition of a request's knobs (issue 44): the SDK's methods, the CLI's
flags and the HTTP body all reach every one of its fields, and nothing else defines them.

Adding a field without carrying it everywhere fails here: :data:`VARIANTS` must set every field to a
value other than its default, and each front end must deliver those values to the wire unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

import pytest

from specserve.api.constraints import Constraint
from specserve.api.errors import InvalidArgument
from specserve.api.params import GenerationParams
from specserve.client import AsyncClient, Client, _codegen
from specserve.coordinator.openai_protocol import ChatCompletionRequest, parse_body
from specserve.launch import cli
from specserve.v1 import coordinator_pb2

pytestmark = pytest.mark.unit

FIELDS = dataclasses.fields(GenerationParams)
#: Every setting away from its default (float values exact in float32, the wire's type).
FULL = GenerationParams(
    max_new_tokens=12,
    temperature=0.5,
    top_k=5,
    top_p=0.875,
    min_p=0.125,
    repetition_penalty=1.25,
    seed=2**63 + 7,
    stop=("\n\n",),
    stop_token_ids=(3, 4),
    ignore_eos=True,
    gamma=4,
    proposer="ngram",
    draft_top_k=8,
    sampling_mode="coupled",
    logprobs=True,
    top_logprobs=3,
    prediction="def f(",
    hybrid_lookup=False,
    min_confidence=0.25,
    keep_special_tokens=True,
    cache_salt="salt-7",
    constraint=Constraint("regex", "[a-z]+"),
)
#: What ``FULL`` cannot hold beside it (``min_new_tokens`` is refused with stop strings and with a constraint).
MINIMUM = GenerationParams(min_new_tokens=2, stop_token_ids=(9,), prediction=(1, 2, 3))
VARIANTS = [FULL, MINIMUM]


def moved(params: GenerationParams) -> set[str]:
    return {f.name for f in FIELDS if getattr(params, f.name) != f.default}


def test_the_variants_set_every_field():
    missing = {f.name for f in FIELDS} - set().union(*map(moved, VARIANTS))
    assert not missing, f"set {sorted(missing)} in VARIANTS (and carry them through every front end)"


@pytest.mark.parametrize("params", [GenerationParams(), *VARIANTS], ids=["defaults", "full", "minimum"])
def test_the_wire_round_trip_is_exact(params):
    assert GenerationParams.from_pb(params.to_pb()) == params


def test_defaults_leave_the_servers_choices_absent():
    pb = GenerationParams().to_pb()
    assert not pb.sampling.HasField("seed") and not pb.sampling.HasField("top_p")
    assert not pb.speculation.HasField("gamma") and not pb.speculation.HasField("min_confidence")
    assert not pb.speculation.HasField("hybrid_lookup")
    assert not pb.HasField("logprobs") and not pb.HasField("prediction") and pb.stop.max_new_tokens == 0


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda pb: setattr(pb.speculation, "proposer", 7), "unknown proposer 7"),
        (lambda pb: setattr(pb.sampling, "sampling_mode", 9), "unknown sampling_mode 9"),
        (lambda pb: setattr(pb.sampling, "temperature", -1.0), "temperature must be >= 0"),
        (lambda pb: pb.stop.stop_strings.append(""), "must not contain the empty string"),
    ],
)
def test_from_pb_checks_what_another_client_sends(mutate, needle):
    pb = GenerationParams().to_pb()
    mutate(pb)
    with pytest.raises(InvalidArgument, match=needle):
        GenerationParams.from_pb(pb)


def test_min_new_tokens_with_a_constraint_is_refused():
    """A grammar complete before ``min_new_tokens`` allows only end-of-sequence, which ``min_new_tokens``
    forbids: no token would be left, so the pair is refused up front."""
    with pytest.raises(InvalidArgument, match="min_new_tokens cannot be combined with a constraint"):
        GenerationParams(min_new_tokens=1, constraint=Constraint("choice", ("yes", "no")))
    GenerationParams(min_new_tokens=0, constraint=Constraint("choice", ("yes", "no")))


# --------------------------------------------------------------------------- the SDK


def test_the_generated_sdk_methods_are_current():
    assert _codegen.TARGET.read_text() == _codegen.render(), "run `python -m specserve.client._codegen`"


METHODS = [(cls, name) for cls in (Client, AsyncClient) for name in ("stream", "generate", "stream_chat", "chat")]


@pytest.mark.parametrize(("cls", "name"), METHODS, ids=[f"{c.__name__}.{n}" for c, n in METHODS])
def test_each_sdk_method_has_one_real_keyword_per_field(cls, name):
    sig = inspect.signature(getattr(cls, name))
    params = list(sig.parameters.values())
    assert all(p.kind is not p.VAR_KEYWORD and p.kind is not p.VAR_POSITIONAL for p in params)
    knobs = [p for p in params if p.name not in ("self", "prompt", "prompt_token_ids", "messages")]
    assert [p.name for p in knobs] == [f.name for f in FIELDS]
    for p, f in zip(knobs, FIELDS, strict=True):
        assert p.kind is p.KEYWORD_ONLY and p.default == f.default, p.name
        assert p.annotation.replace('"', "'") == str(f.type).replace('"', "'"), p.name
    assert inspect.iscoroutinefunction(getattr(cls, name)) == (cls is AsyncClient and name in ("generate", "chat"))


class _Captured(Exception):
    def __init__(self, request: coordinator_pb2.GenerateRequest) -> None:
        self.request = request


class CaptureClient(Client):
    """A client whose requests stop at the wire: ``_open`` raises with the request it was given."""

    def _open(self, request: coordinator_pb2.GenerateRequest) -> Any:
        raise _Captured(request)


class CaptureAsyncClient(AsyncClient):
    def _open(self, request: coordinator_pb2.GenerateRequest) -> Any:
        raise _Captured(request)


@pytest.mark.parametrize("params", VARIANTS, ids=["full", "minimum"])
@pytest.mark.parametrize(("cls", "name"), METHODS, ids=[f"{c.__name__}.{n}" for c, n in METHODS])
async def test_each_sdk_method_sends_every_field(cls, name, params):
    capture = {Client: CaptureClient, AsyncClient: CaptureAsyncClient}[cls]("127.0.0.1:1")
    first = [{"role": "user", "content": "hi"}] if "chat" in name else "hi"
    with pytest.raises(_Captured) as caught:
        result = getattr(capture, name)(first, **params.as_kwargs())
        if inspect.iscoroutine(result):
            await result
    assert GenerationParams.from_pb(caught.value.request) == params
    if isinstance(capture, Client):
        capture.close()


# --------------------------------------------------------------------------- the CLI

#: Fields ``specserve generate`` / ``chat`` leave out: they print text and statistics, not logprobs,
#: and take no prediction.
NOT_ON_THE_CLI = {"logprobs", "top_logprobs", "prediction"}


def argv_for(params: GenerationParams) -> list[str]:
    """``specserve generate`` flags for ``params``, from the parser's own options."""
    parser = cli._request_flags()
    flags = {a.dest: a for a in parser._actions}
    argv = []
    for f in FIELDS:
        value = getattr(params, f.name)
        if f.name in NOT_ON_THE_CLI or value == f.default:
            continue
        action = flags[f.name]
        if isinstance(value, Constraint):  # --constraint KIND:VALUE
            shown = json.dumps(list(value.choices)) if value.kind == "choice" else value.text
            argv += [action.option_strings[0], f"{value.kind}:{shown}" if shown else value.kind]
        elif isinstance(value, bool):
            argv.append(action.option_strings[0] if value else action.option_strings[-1])
        elif isinstance(value, tuple):
            for item in value:
                argv += [action.option_strings[0], str(item)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def test_every_field_but_the_named_ones_is_a_flag():
    dests = {a.dest for a in cli._request_flags()._actions}
    assert {f.name for f in FIELDS} - dests == NOT_ON_THE_CLI


@pytest.mark.parametrize("params", VARIANTS, ids=["full", "minimum"])
def test_the_cli_flags_carry_every_field(params):
    args = cli.build_parser().parse_args(["generate", "hi", *argv_for(params)])
    expected = dataclasses.replace(params, **{name: getattr(GenerationParams(), name) for name in NOT_ON_THE_CLI})
    assert cli._request_params(args) == expected


# --------------------------------------------------------------------------- the HTTP API

#: FULL as an OpenAI chat body (the extensions are vLLM's names, and ``speculation``).
FULL_BODY = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 12,
    "temperature": 0.5,
    "top_k": 5,
    "top_p": 0.875,
    "min_p": 0.125,
    "repetition_penalty": 1.25,
    "seed": 2**63 + 7,
    "stop": ["\n\n"],
    "stop_token_ids": [3, 4],
    "ignore_eos": True,
    "speculation": {
        "gamma": 4,
        "proposer": "ngram",
        "draft_top_k": 8,
        "sampling_mode": "coupled",
        "hybrid_lookup": False,
        "min_confidence": 0.25,
    },
    "logprobs": True,
    "top_logprobs": 3,
    "prediction": {"type": "content", "content": "def f("},
    "skip_special_tokens": False,
    "guided_regex": "[a-z]+",
    "cache_salt": "salt-7",
}


#: Fields no HTTP body reaches (every one does; ``constraint`` through the structured-output fields,
#: specserve/coordinator/structured_outputs.py).
NOT_OVER_HTTP: set[str] = set()


def test_the_http_body_carries_every_field():
    body = parse_body(ChatCompletionRequest, FULL_BODY)
    body.check_supported()
    assert body.generation()[0] == FULL
    minimum = parse_body(ChatCompletionRequest, {**FULL_BODY, "min_tokens": 2, "stop": None, "guided_regex": None})
    assert minimum.generation()[0].min_new_tokens == 2
    # Prediction token ids are the one form HTTP lacks (OpenAI's prediction is text).
    reached = moved(body.generation()[0]) | {"min_new_tokens"}
    assert reached == {f.name for f in FIELDS} - NOT_OVER_HTTP


def test_a_bad_setting_over_http_is_the_same_refusal():
    body = parse_body(ChatCompletionRequest, {**FULL_BODY, "temperature": 0.001})
    with pytest.raises(InvalidArgument, match=r"temperature=0\.001 is too small"):
        body.generation()


def test_a_cache_salt_out_of_bounds_is_refused_naming_it():
    for bad in ("", "s" * 1025):
        with pytest.raises(InvalidArgument, match="cache_salt has"):
            GenerationParams(cache_salt=bad)
    with pytest.raises(InvalidArgument, match="cache_salt must be a string"):
        GenerationParams(cache_salt=7)  # type: ignore[arg-type]
    assert GenerationParams(cache_salt="s" * 1024).cache_salt == "s" * 1024


def test_http_cache_salt_and_prompt_cache_key_each_make_a_salt_of_their_own():
    """Over HTTP both fields scope the cache: each value, and each pair, is a salt no other value gives."""
    base = {"messages": [{"role": "user", "content": "hi"}]}

    def salt(**fields: str) -> str | None:
        return parse_body(ChatCompletionRequest, {**base, **fields}).generation()[0].cache_salt

    salts = [salt(), salt(cache_salt="a"), salt(prompt_cache_key="a"), salt(cache_salt="a", prompt_cache_key="b")]
    assert salts[0] is None and salts[1] == "a"
    assert len(set(salts)) == len(salts)
    assert salt(cache_salt="a", prompt_cache_key="b") == salt(prompt_cache_key="b", cache_salt="a")
