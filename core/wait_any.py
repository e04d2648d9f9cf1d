"""Sleeping until a deadline or an event, whichever comes first: the relay,
the workers and the backends all wait this way."""

from __future__ import annotations

import asyncio


async def wait_any(timeout: float, *events: asyncio.Event) -> None:  # noqa: ASYNC109
    """Return when any event is set or ``timeout`` seconds passed.

    Callers clear the wake-up events they own; a stop event is left set.
    """
    if timeout <= 0 or any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        # Let them finish without catching a CancelledError here: a
        # cancellation of the *caller* that lands now arrives as one too.
        # ``suppress(CancelledError)`` around ``await w`` swallowed it, and a
        # loop that ends only when cancelled (the sql:// claimer, a worker's
        # consumer) ran on: a stop that never finished (issue #24).
        await asyncio.wait(waiters)
