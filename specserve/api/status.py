"""The one mapping between gRPC status codes and :mod:`specserve.api.errors`, in every direction.

Each error class names the status code it becomes (``grpc_code_name``); this
module holds everything else about crossing a gRPC boundary:

* **server -> wire** (:class:`specserve.runtime.server.ErrorInterceptor`):
  :func:`status_code_for` a raised exception, and :func:`trailers_for` it: the
  exact class name (:data:`ERROR_CLASS_KEY`, so a client can raise
  ``VersionConflict`` rather than only the ``Aborted`` its code implies) and a
  retry hint (:data:`RETRY_AFTER_KEY`);
* **wire -> SDK** (:mod:`specserve.client`): :func:`error_from_rpc`, the class
  from :data:`ERRORS_BY_CODE` (every code but OK), narrowed by the trailer when
  the server named a class consistent with the code;
* **wire -> coordinator** (the worker clients in ``specserve/coordinator/fleet/clients.py``):
  :func:`worker_error_from_rpc`, the same table and trailers, except that a code
  no specserve error names (:data:`BUG_CODES`: UNKNOWN, INTERNAL, ...) means the
  replica is broken and becomes :class:`~specserve.api.errors.WorkerError`, and a
  conflict is a lost compare-and-set (``VersionConflict``);
* **per item** (a ``VerifyResult`` carries a bare code and a message):
  :func:`item_code` on the target, :func:`item_error` on the coordinator.

``tests/specserve/api/test_status.py`` checks that every direction is complete.
Only grpc and the standard library: the SDK imports this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import grpc

from specserve.api import errors

__all__ = [
    "BUG_CODES",
    "ERRORS_BY_CODE",
    "ERROR_CLASS_KEY",
    "ITEM_CODES",
    "REPLICA_FAULT_CODES",
    "RETRY_AFTER_KEY",
    "error_class",
    "error_from_rpc",
    "item_code",
    "item_error",
    "retry_after",
    "status_code_for",
    "trailers_for",
    "worker_error_from_rpc",
]

#: Trailing metadata key naming the exact error class (e.g. ``VersionConflict``).
ERROR_CLASS_KEY = "specserve-error"
#: Trailing metadata key carrying ``SpecServeError.retry_after_s``, in seconds.
RETRY_AFTER_KEY = "specserve-retry-after-s"

#: The error each status code becomes on the receiving side (every code but OK).
ERRORS_BY_CODE: dict[grpc.StatusCode, type[errors.SpecServeError]] = {
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.UNKNOWN: errors.SpecServeError,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.Aborted,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.ABORTED: errors.Aborted,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.UNIMPLEMENTED: errors.FailedPrecondition,
    grpc.StatusCode.INTERNAL: errors.SpecServeError,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DATA_LOSS: errors.SpecServeError,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
}

_CLASSES_BY_NAME = {cls.__name__: cls for cls in errors.all_error_classes()}

#: Codes that no specserve error names: a specserve server sends them only for a bug
#: (INTERNAL), and a foreign or broken server for anything.
BUG_CODES = frozenset(
    code
    for code in ERRORS_BY_CODE
    if code.name
    not in {cls.grpc_code_name for cls in _CLASSES_BY_NAME.values() if cls is not errors.SpecServeError}
)

#: The codes a target sends for one item of a Verify call (the session's state, not the call, is the problem).
ITEM_CODES = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)
_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}

#: Codes that say the replica (or the way to it) failed, not the request: gRPC writes their details.
REPLICA_FAULT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


# --------------------------------------------------------------------------- server -> wire


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The status a raised exception becomes at a server boundary (INTERNAL: a bug)."""
    if isinstance(exc, errors.SpecServeError):
        return grpc.StatusCode[exc.grpc_code_name]
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def trailers_for(exc: errors.SpecServeError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for a domain error: its exact class, and its retry hint if it has one."""
    trailers = [(ERROR_CLASS_KEY, type(exc).__name__)]
    if exc.retry_after_s is not None:
        trailers.append((RETRY_AFTER_KEY, f"{exc.retry_after_s:g}"))
    return tuple(trailers)


# --------------------------------------------------------------------------- wire -> caller


def error_class(
    code: grpc.StatusCode, trailing: Iterable[tuple[str, Any]] | None
) -> type[errors.SpecServeError]:
    """The class for ``code``, narrowed to the class the server named in ``trailing`` when consistent.

    Only a named class that is the code's own class or a subclass of it is trusted (never a wider one).
    """
    cls = ERRORS_BY_CODE.get(code, errors.SpecServeError)
    for key, value in trailing or ():
        if key == ERROR_CLASS_KEY:
            named = _CLASSES_BY_NAME.get(value)
            if named is not None and issubclass(named, cls):
                cls = named
    return cls


def retry_after(trailing: Iterable[tuple[str, Any]] | None) -> float | None:
    """The retry hint in ``trailing``, in seconds (None when absent or unreadable)."""
    for key, value in trailing or ():
        if key == RETRY_AFTER_KEY:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str | None, Any]:
    """``(code, details, trailing metadata)`` of a failed call (UNKNOWN where the object has no code)."""
    code, details, trailing = (getattr(exc, name, None) for name in ("code", "details", "trailing_metadata"))
    return (
        code() if callable(code) else grpc.StatusCode.UNKNOWN,
        details() if callable(details) else None,
        trailing() if callable(trailing) else None,
    )


def error_from_rpc(exc: grpc.RpcError, address: str = "") -> errors.SpecServeError:
    """The SDK exception for a failed call to a coordinator: class from the status code, message from the server.

    The result has ``status_code`` (the ``grpc.StatusCode``) and, where the server
    sent one, ``retry_after_s``. Raise it ``from exc``.
    """
    code, details, trailing = _status(exc)
    details = details or ""
    cls = error_class(code, trailing)
    if code == grpc.StatusCode.UNAVAILABLE and address:
        details = f"{details} (coordinator at {address})" if details else f"cannot reach {address}"
    elif code == grpc.StatusCode.UNIMPLEMENTED:
        details = f"{details}: is {address or 'the address'} a specserve coordinator?"
    err = cls(details or f"the call failed with status {code.name}", retry_after_s=retry_after(trailing))
    err.status_code = code  # type: ignore[attr-defined]
    return err


def worker_error_from_rpc(exc: grpc.RpcError, endpoint: str) -> errors.SpecServeError:
    """The error a failed call to the worker replica at ``endpoint`` becomes in the coordinator.

    As :func:`error_from_rpc`, except: a :data:`BUG_CODES` code means the replica is broken
    (:class:`~specserve.api.errors.WorkerError`, an ``Unavailable``: the caller fails over), and a
    conflict is a lost compare-and-set (``VersionConflict``).

    The message may reach a client, so it never names the endpoint: for the codes a specserve
    worker sends on purpose it is the worker's own message (what to fix); for a fault of the
    replica (:data:`REPLICA_FAULT_CODES`, whose details are gRPC's and name addresses) it says
    only which code. The result carries ``endpoint`` and ``detail`` (endpoint, code, the
    details as received) for the server's log.
    """
    code, details, trailing = _status(exc)
    detail = f"{endpoint}: {code.name}: {details if details is not None else exc}"
    if code in BUG_CODES:
        err: errors.SpecServeError = errors.WorkerError(f"a worker replica failed ({code.name})")
    else:
        cls = _conflict_is_version(error_class(code, trailing))
        message = f"a worker replica failed ({code.name})" if code in REPLICA_FAULT_CODES else details or code.name
        err = cls(message, retry_after_s=retry_after(trailing))
    err.endpoint = endpoint  # type: ignore[attr-defined]
    err.detail = detail  # type: ignore[attr-defined]
    return err


def _conflict_is_version(cls: type[errors.SpecServeError]) -> type[errors.SpecServeError]:
    """Between the coordinator and a worker the only conflict is a lost compare-and-set."""
    return errors.VersionConflict if cls is errors.Aborted else cls


# --------------------------------------------------------------------------- per item


def item_code(error: errors.SpecServeError) -> int:
    """The numeric status code a per-item error travels as (``ItemError.code``)."""
    return grpc.StatusCode[error.grpc_code_name].value[0]


def item_error(code: int, message: str) -> errors.SpecServeError:
    """The error for a per-item code; a code outside :data:`ITEM_CODES` is a ``FailedPrecondition``."""
    status = _CODES_BY_VALUE.get(code)
    if status not in ITEM_CODES:
        return errors.FailedPrecondition(message)
    return _conflict_is_version(ERRORS_BY_CODE[status])(message)
