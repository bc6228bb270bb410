"""What a draft replica knows of each session's committed tokens.

The coordinator ships only the committed tokens a draft has not seen
(``ProposeRequest.start_position``). :class:`CommittedHistory` keeps, per
session, the committed prefix ``C`` as of the last Propose, so the next request
can be appended to it; a session it does not hold (never seen, released,
evicted, expired) can only be rebuilt from position 0, and a request starting
later gets :class:`~specserve.api.errors.FailedPrecondition` so the caller resends
from 0. Sessions are kept LRU with a count limit and an idle TTL, like the KV
caches; the history is the source of truth the caches are reconciled against.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import structlog

from specserve.api.errors import FailedPrecondition, NotFound

log = structlog.get_logger(__name__)


class CommittedHistory:
    """Per-session committed tokens, LRU by count, released after ``ttl_s`` idle."""

    def __init__(self, *, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()  # least recently used first
        self._last_used: dict[str, float] = {}

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def known(self, session_id: str) -> tuple[int, ...]:
        """The committed tokens known for ``session_id`` (empty when unknown)."""
        return tuple(self._tokens.get(session_id, ()))

    def resolve(self, session_id: str, start_position: int, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The full committed prefix: the known tokens before ``start_position`` + ``token_ids``.

        Raises :class:`FailedPrecondition` when fewer than ``start_position`` tokens are known.
        Does not record anything (see :meth:`record`).
        """
        known = self._tokens.get(session_id, [])
        if start_position > len(known):
            raise FailedPrecondition(
                f"this draft knows {len(known)} committed tokens of session {session_id!r}, fewer than "
                f"start_position={start_position}; resend the committed tokens from position 0"
            )
        return (*known[:start_position], *(int(t) for t in token_ids))

    def record(self, session_id: str, committed: Sequence[int]) -> list[str]:
        """Remember ``committed`` for the session; returns the sessions evicted or expired to make room."""
        dropped = self.release_expired()
        if session_id not in self._tokens:
            while len(self._tokens) >= self.max_sessions:
                sid, _ = self._tokens.popitem(last=False)
                del self._last_used[sid]
                log.info("session_evicted", session_id=sid, reason="max_sessions")
                dropped.append(sid)
        self._tokens[session_id] = list(committed)
        self._tokens.move_to_end(session_id)
        self._last_used[session_id] = self._clock()
        return dropped

    def release(self, session_id: str) -> None:
        if self._tokens.pop(session_id, None) is None:
            raise NotFound(
                f"session {session_id!r} is not known to this draft (never seen, released or expired)"
            )
        del self._last_used[session_id]

    def release_expired(self) -> list[str]:
        now = self._clock()
        expired = [sid for sid, t in self._last_used.items() if now - t > self.ttl_s]
        for sid in expired:
            del self._tokens[sid]
            del self._last_used[sid]
            log.info("session_released", session_id=sid, reason="ttl")
        return expired
