"""The one exception hierarchy of specserve.

Every error a role raises on purpose is a :class:`SpecServeError`. Each class
names the gRPC status code it becomes at a server boundary
(:data:`grpc_code_name`); :mod:`specserve.api.status` holds the one mapping back
from codes to classes (for the SDK and the coordinator's worker clients), and
a test checks that every direction is complete. Each also subclasses the builtin it is a
kind of, so callers may catch ``ValueError`` or ``LookupError`` as usual::

    SpecServeError (Exception)
    ├── InvalidArgument (ValueError)             INVALID_ARGUMENT
    │   ├── InvalidDistribution                  INVALID_ARGUMENT
    │   │   ├── ZeroDraftProbability             proposed token has q = 0
    │   │   └── ZeroResidualMass                 rejection with max(0, p - q) = 0
    │   └── VocabularyMismatch                   draft and target disagree
    ├── NotFound (LookupError)                   NOT_FOUND
    ├── FailedPrecondition (RuntimeError)        FAILED_PRECONDITION
    │   └── SessionFinished                      the session already stopped
    ├── Aborted (RuntimeError)                   ABORTED
    │   └── VersionConflict                      compare-and-set lost
    ├── ResourceExhausted (RuntimeError)         RESOURCE_EXHAUSTED
    ├── Unavailable (ConnectionError)            UNAVAILABLE
    │   └── WorkerError                          a worker replica is broken (answered INTERNAL, ...)
    ├── DeadlineExceeded (TimeoutError)          DEADLINE_EXCEEDED
    ├── Unauthenticated (PermissionError)        UNAUTHENTICATED
    ├── PermissionDenied (PermissionError)       PERMISSION_DENIED
    └── Cancelled (RuntimeError)                 CANCELLED

Anything else escaping a servicer is a bug and becomes INTERNAL.

This module imports nothing heavier than the standard library: the SDK uses it.
"""

from __future__ import annotations


class SpecServeError(Exception):
    """Base of every error specserve raises on purpose."""

    #: Name of the ``grpc.StatusCode`` member this error maps to.
    grpc_code_name: str = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: A hint for RESOURCE_EXHAUSTED / UNAVAILABLE: when to try again.
        self.retry_after_s = retry_after_s


class InvalidArgument(SpecServeError, ValueError):
    """The request is malformed; it will never succeed as sent."""

    grpc_code_name = "INVALID_ARGUMENT"


class InvalidDistribution(InvalidArgument):
    """A probability vector is negative, NaN, or does not sum to one."""


class ZeroDraftProbability(InvalidDistribution):
    """A proposed token has probability 0 under the distribution it was said to come from."""


class ZeroResidualMass(InvalidDistribution):
    """A rejection happened where ``max(0, p - q)`` has no mass: impossible for a true q."""


class VocabularyMismatch(InvalidArgument):
    """The draft and the target do not share one token table."""


class NotFound(SpecServeError, LookupError):
    """A session (or other named thing) does not exist."""

    grpc_code_name = "NOT_FOUND"


class FailedPrecondition(SpecServeError, RuntimeError):
    """The system is not in the state the request requires."""

    grpc_code_name = "FAILED_PRECONDITION"


class SessionFinished(FailedPrecondition):
    """The session already reached a stop condition; nothing more is committed."""


class Aborted(SpecServeError, RuntimeError):
    """A concurrency conflict; the caller may re-read state and retry."""

    grpc_code_name = "ABORTED"


class VersionConflict(Aborted):
    """The commit's base version is not the session's current version."""


class ResourceExhausted(SpecServeError, RuntimeError):
    """A limit was hit (message size, sessions, batch size)."""

    grpc_code_name = "RESOURCE_EXHAUSTED"


class Unavailable(SpecServeError, ConnectionError):
    """A dependency (worker, Redis) cannot be reached right now; retry later."""

    grpc_code_name = "UNAVAILABLE"


class WorkerError(Unavailable):
    """A worker replica failed in a way that is its bug (INTERNAL, UNKNOWN, a malformed reply).

    The coordinator treats the replica as down: its breaker opens and the call moves on.
    """


class DeadlineExceeded(SpecServeError, TimeoutError):
    """The call ran out of time."""

    grpc_code_name = "DEADLINE_EXCEEDED"


class Unauthenticated(SpecServeError, PermissionError):
    """No valid credentials were presented."""

    grpc_code_name = "UNAUTHENTICATED"


class PermissionDenied(SpecServeError, PermissionError):
    """Credentials were valid but do not allow this call."""

    grpc_code_name = "PERMISSION_DENIED"


class Cancelled(SpecServeError, RuntimeError):
    """The caller cancelled the request."""

    grpc_code_name = "CANCELLED"


def all_error_classes() -> list[type[SpecServeError]]:
    """Every concrete error class, for completeness checks of the mappings."""
    seen: list[type[SpecServeError]] = []
    stack: list[type[SpecServeError]] = [SpecServeError]
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return seen
