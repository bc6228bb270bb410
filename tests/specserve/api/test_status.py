"""The one status mapping is complete in every direction: server -> wire -> SDK, worker, per item.

No servers here: a fake received status pairs any code with any trailing metadata.
The live round trips (a real server raising each class, the SDK receiving it) are
in ``test_server.py`` and ``test_client.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from specserve.api import errors, status

ALL_CODES = set(grpc.StatusCode) - {grpc.StatusCode.OK}
CLASSES = errors.all_error_classes()


class Received(grpc.RpcError):
    """A stand-in for a failed call as a client sees it."""

    def __init__(self, code: grpc.StatusCode, details: str = "boom", trailing=()) -> None:
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def sent(exc: errors.SpecServeError) -> Received:
    """What a specserve server puts on the wire for ``exc`` (code, message, trailers)."""
    return Received(status.status_code_for(exc), exc.message, status.trailers_for(exc))


# --------------------------------------------------------------------------- server -> wire


@pytest.mark.unit
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_has_a_code_and_names_itself(cls):
    exc = cls("x", retry_after_s=1.5)
    code = status.status_code_for(exc)
    assert code.name == cls.grpc_code_name and code != grpc.StatusCode.OK
    trailers = dict(status.trailers_for(exc))
    assert trailers == {status.ERROR_CLASS_KEY: cls.__name__, status.RETRY_AFTER_KEY: "1.5"}
    assert status.RETRY_AFTER_KEY not in dict(status.trailers_for(cls("x")))


@pytest.mark.unit
def test_a_bug_and_a_cancellation_have_their_codes():
    assert status.status_code_for(KeyError("bug")) == grpc.StatusCode.INTERNAL
    assert status.status_code_for(asyncio.CancelledError()) == grpc.StatusCode.CANCELLED


# --------------------------------------------------------------------------- wire -> SDK


@pytest.mark.unit
def test_every_code_maps_to_an_error_class():
    assert set(status.ERRORS_BY_CODE) == ALL_CODES
    for code in ALL_CODES:
        err = status.error_from_rpc(Received(code))
        assert isinstance(err, status.ERRORS_BY_CODE[code]) and err.status_code == code


@pytest.mark.unit
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_comes_back_exactly_through_the_sdk(cls):
    err = status.error_from_rpc(sent(cls("it happened", retry_after_s=2.0)), "h:1")
    assert type(err) is cls and err.retry_after_s == 2.0
    assert "it happened" in err.message
    # Without the trailer the code alone gives the class or one of its bases.
    bare = status.error_from_rpc(Received(status.status_code_for(cls("x"))))
    assert isinstance(cls("x"), type(bare))


@pytest.mark.unit
def test_a_named_class_is_trusted_only_within_its_code():
    wider = Received(grpc.StatusCode.ABORTED, trailing=[(status.ERROR_CLASS_KEY, "InvalidArgument")])
    assert type(status.error_from_rpc(wider)) is errors.Aborted
    unknown = Received(grpc.StatusCode.ABORTED, trailing=[(status.ERROR_CLASS_KEY, "NoSuchError")])
    assert type(status.error_from_rpc(unknown)) is errors.Aborted
    garbled = Received(grpc.StatusCode.UNAVAILABLE, trailing=[(status.RETRY_AFTER_KEY, "soon")])
    assert status.error_from_rpc(garbled).retry_after_s is None


# --------------------------------------------------------------------------- wire -> coordinator


@pytest.mark.unit
def test_bug_codes_are_the_codes_no_error_class_names():
    named = {c.grpc_code_name for c in CLASSES if c is not errors.SpecServeError}
    assert {c.name for c in status.BUG_CODES} == {c.name for c in ALL_CODES} - named
    assert grpc.StatusCode.INTERNAL in status.BUG_CODES and grpc.StatusCode.UNKNOWN in status.BUG_CODES


@pytest.mark.unit
@pytest.mark.parametrize("code", sorted(ALL_CODES, key=lambda c: c.value[0]), ids=lambda c: c.name)
def test_every_code_from_a_worker_is_a_domain_error_whose_message_never_names_the_endpoint(code):
    """The message may reach a client: the worker's own text for what it sends on purpose, only the code for
    a replica fault (gRPC's details name addresses); the endpoint and the details are kept for the log."""
    err = status.worker_error_from_rpc(Received(code), "10.0.0.1:50052")
    assert isinstance(err, errors.SpecServeError)
    fault = code in status.BUG_CODES or code in status.REPLICA_FAULT_CODES
    assert err.message == (f"a worker replica failed ({code.name})" if fault else "boom")
    assert "10.0.0.1" not in err.message
    assert err.endpoint == "10.0.0.1:50052" and err.detail == f"10.0.0.1:50052: {code.name}: boom"
    if code in status.BUG_CODES:
        assert type(err) is errors.WorkerError and isinstance(err, errors.Unavailable)
    elif code == grpc.StatusCode.ABORTED:
        assert type(err) is errors.VersionConflict
    else:
        assert type(err) is status.ERRORS_BY_CODE[code]


@pytest.mark.unit
@pytest.mark.parametrize("cls", CLASSES[1:], ids=lambda c: c.__name__)
def test_every_class_a_worker_raises_arrives_in_the_coordinator(cls):
    err = status.worker_error_from_rpc(sent(cls("it happened")), "w:1")
    expected = errors.VersionConflict if cls is errors.Aborted else cls
    assert type(err) is expected


# --------------------------------------------------------------------------- per item


@pytest.mark.unit
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_item_error_round_trips_to_its_code_family(cls):
    code = status.item_code(cls("x"))
    assert code == grpc.StatusCode[cls.grpc_code_name].value[0]
    back = status.item_error(code, "x")
    if grpc.StatusCode[cls.grpc_code_name] in status.ITEM_CODES:
        assert back.grpc_code_name == cls.grpc_code_name
        assert isinstance(back, errors.VersionConflict) or isinstance(cls("x"), type(back))
    else:
        assert type(back) is errors.FailedPrecondition
    assert back.message == "x"


@pytest.mark.unit
def test_an_unknown_item_code_is_a_failed_precondition():
    assert type(status.item_error(999, "?")) is errors.FailedPrecondition


# --------------------------------------------------------------------------- SDK-light


@pytest.mark.system
def test_status_and_the_sdk_import_without_the_serving_stack():
    """specserve.api.status (and the SDK that uses it) needs grpc and protobuf only."""
    hidden = ("torch", "transformers", "redis", "structlog", "numpy", "pydantic", "pydantic_settings")
    code = textwrap.dedent(
        f"""
        import sys

        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in {hidden!r}:
                    raise ModuleNotFoundError(name)

        sys.meta_path.insert(0, Hide())
        import specserve.api.status, specserve.client
        from specserve import Client
        print("ok")
        """
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
