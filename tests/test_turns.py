"""consumers/turns.py: handlers of one ordering key start in arrival order."""

from __future__ import annotations

import asyncio

from duebox.consumers.turns import Turns


async def test_a_later_delivery_of_a_key_waits_for_the_earlier_one() -> None:
    turns = Turns()
    first, second = turns.take("acct-1"), turns.take("acct-1")
    await first.wait()  # nobody before it
    waiting = asyncio.create_task(second.wait())
    await asyncio.sleep(0)
    assert not waiting.done()
    first.pass_on()
    await asyncio.wait_for(waiting, 5)


async def test_other_keys_never_wait() -> None:
    turns = Turns()
    turns.take("acct-1")
    await asyncio.wait_for(turns.take("acct-2").wait(), 5)


async def test_a_dropped_delivery_keeps_its_place_in_line() -> None:
    """The middle one is dropped (stale, deferred) before the first was
    handed over: the third still waits for the first."""
    turns = Turns()
    first, middle, third = (turns.take("k") for _ in range(3))
    middle.pass_on()
    waiting = asyncio.create_task(third.wait())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not waiting.done()
    first.pass_on()
    await asyncio.wait_for(waiting, 5)


async def test_a_key_is_forgotten_when_its_last_delivery_passed_on() -> None:
    turns = Turns()
    a, b = turns.take("k"), turns.take("k")
    a.pass_on()
    b.pass_on()
    await asyncio.sleep(0)
    assert len(turns) == 0


async def test_a_cancelled_waiter_does_not_break_the_line() -> None:
    """A delivery cancelled while it waits (the worker stops) passes on in its
    finally; the one after it still waits for the first."""
    turns = Turns()
    first, second, third = (turns.take("k") for _ in range(3))
    waiting = asyncio.create_task(second.wait())
    await asyncio.sleep(0)
    waiting.cancel()
    second.pass_on()
    after = asyncio.create_task(third.wait())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not after.done()
    first.pass_on()
    await asyncio.wait_for(after, 5)
