"""structlog set-up shared by every role.

``configure_logging`` is called once by each server's entry point (never at
import time). Library modules only do ``log = structlog.get_logger(__name__)``
and log key-value events with ``session_id``. Values listed as secrets (bearer
tokens, Redis passwords) are replaced by ``***`` wherever they appear in an event;
:func:`settings_secrets` lists them for a role's settings, and every entry point
passes that list to :func:`configure_logging`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

import structlog


def settings_secrets(settings: Any) -> list[str]:
    """The secrets in a role's settings: its bearer tokens, the worker token, the Redis URL's password."""
    from urllib.parse import unquote, urlsplit

    found = [t.get_secret_value() for t in getattr(settings, "auth_tokens", ())]
    worker_token = getattr(settings, "worker_token", None)
    if worker_token is not None:
        found.append(worker_token.get_secret_value())
    redis_url = getattr(settings, "redis_url", None)
    if redis_url is not None:
        url = redis_url.get_secret_value() if hasattr(redis_url, "get_secret_value") else str(redis_url)
        password = urlsplit(url).password
        if password:
            found += [password] if unquote(password) == password else [password, unquote(password)]
    return found


def _redactor(secrets: Iterable[str]):
    secrets = tuple(s for s in secrets if s)

    def redact(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        if not secrets:
            return event
        for key, value in list(event.items()):
            text = value if isinstance(value, str) else None
            if text is None and not isinstance(value, (int, float, bool, type(None))):
                text = str(value)
            if text is not None and any(s in text for s in secrets):
                for s in secrets:
                    text = text.replace(s, "***")
                event[key] = text
        return event

    return redact


def _current_stderr(*_args: Any) -> structlog.PrintLogger:
    """A logger writing to whatever ``sys.stderr`` is at the time of the call (it may be swapped)."""
    return structlog.PrintLogger(file=sys.stderr)


def configure_logging(
    fmt: str = "console", level: str = "info", *, secrets: Iterable[str] = (), stream: Any = None
) -> None:
    """Configure structlog: ``fmt`` is ``"json"`` (production) or ``"console"``."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _redactor(secrets),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream) if stream is not None else _current_stderr,
        cache_logger_on_first_use=False,
    )
