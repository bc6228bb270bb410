"""The one way a test waits for something to happen: poll a condition until it holds, or fail naming it.

``await wait_until(predicate, timeout_s=..., what=...)`` in a coroutine (the predicate may be a plain
function or a coroutine function); ``wait_until_blocking`` where no event loop runs (a process starting or
exiting). Both raise ``TimeoutError`` saying what was awaited. The timeout is a bound on a hang, never an
assertion about speed: pick one far above what the wait should take.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout_s: float, what: str, poll_s: float = 0.01
) -> None:
    """Poll ``predicate`` every ``poll_s`` until it holds; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        _check(deadline, timeout_s, what)
        await asyncio.sleep(poll_s)


def wait_until_blocking(
    predicate: Callable[[], bool], *, timeout_s: float, what: str, poll_s: float = 0.02
) -> None:
    """:func:`wait_until` for code outside an event loop: blocks the calling thread while it polls."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        _check(deadline, timeout_s, what)
        time.sleep(poll_s)


def _check(deadline: float, timeout_s: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
