"""``wait_any``: a cancellation of its caller always ends the caller (issue #24).

A worker stopping cancels its consumer; the sql:// consumer and its claimer
are loops that end only when cancelled, each sleeping in ``wait_any``.  A
cancel that landed while ``wait_any`` was cancelling its own waiters was
swallowed there, the loop went on, and the stop never finished (tests timed
out in ``Running.__aexit__``: test_dlq/test_failures on PostgreSQL).

No clocks: the event loop is stepped one iteration at a time
(``asyncio.sleep(0)``) and the cancel is sent at every step of the wake-up.
"""

from __future__ import annotations

import asyncio

from duebox.wait_any import wait_any


async def _steps(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _loop_until_cancelled(seconds: float, wake: asyncio.Event,
                                *others: asyncio.Event) -> None:
    """Like the sql:// claimer: only a cancel ends it."""
    while True:
        await wait_any(seconds, wake, *others)
        wake.clear()


async def _cancel_after(caller: asyncio.Task[None], step: int) -> bool:
    """Cancel ``caller`` ``step`` loop iterations from now; whether it ended,
    cancelled, within the next 20 iterations."""
    await _steps(step)
    caller.cancel()
    await _steps(20)
    return caller.done() and caller.cancelled()


async def test_a_cancel_at_any_step_of_a_wake_up_ends_the_caller() -> None:
    for step in range(12):
        woken = asyncio.Event()
        caller = asyncio.create_task(_loop_until_cancelled(3600, woken, asyncio.Event()))
        await _steps(2)  # inside asyncio.wait, both waiters pending
        woken.set()
        # Somewhere in the wake-up and the clean-up of the other waiter.
        assert await _cancel_after(caller, step), f"cancelled {step} steps into a wake-up"


async def test_a_cancel_during_the_timeout_clean_up_ends_the_caller() -> None:
    for step in range(8):
        caller = asyncio.create_task(_loop_until_cancelled(0.001, asyncio.Event()))
        await asyncio.sleep(0.01)  # it has timed out at least once
        assert await _cancel_after(caller, step), f"cancelled {step} steps after a timeout"
