"""core/batched_calls.py: calls that queue up are served together; a batch
that fails as a whole is retried item by item, so one bad item fails alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from duebox.batched_calls import Batched
from duebox.consumers.execution import Pools


def in_thread(run: Callable[[list[int]], list[int]]) -> Callable[[list[int]], Awaitable[list[int]]]:
    return lambda items: Pools().db(run, items)


async def test_calls_made_while_one_runs_are_served_together() -> None:
    release, entered = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) == 1:
            entered.set()
            assert release.wait(10)
        return [i * 10 for i in items]

    b: Batched[int, int] = Batched("testing", in_thread(run), lanes=1)
    first = asyncio.create_task(b.call(0))
    assert await asyncio.to_thread(entered.wait, 10)  # it holds the only lane
    rest = [asyncio.create_task(b.call(i)) for i in range(1, 6)]
    release.set()
    assert await first == 0
    assert [await t for t in rest] == [10, 20, 30, 40, 50]
    assert batches == [[0], [1, 2, 3, 4, 5]]


async def test_a_failing_batch_is_retried_item_by_item() -> None:
    seen: list[list[int]] = []
    release, entered = threading.Event(), threading.Event()

    def run(items: list[int]) -> list[int]:
        seen.append(items)
        if len(seen) == 1:
            entered.set()
            assert release.wait(10)
        if 3 in items:
            raise RuntimeError("item 3 is bad")
        return items

    b: Batched[int, int] = Batched("testing", in_thread(run), lanes=1)
    first = asyncio.create_task(b.call(0))
    assert await asyncio.to_thread(entered.wait, 10)
    rest = [asyncio.create_task(b.call(i)) for i in range(1, 6)]
    release.set()
    await first
    results = await asyncio.gather(*rest, return_exceptions=True)
    assert results[:2] == [1, 2]
    assert results[3:] == [4, 5]
    assert isinstance(results[2], RuntimeError)
    assert seen[1] == [1, 2, 3, 4, 5]
    assert seen[2:] == [[1], [2], [3], [4], [5]]
    with pytest.raises(RuntimeError):
        await b.call(3)  # alone, it fails alone


async def test_with_a_linger_calls_made_meanwhile_go_together_and_flush_sends_at_once() -> None:
    batches: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        batches.append(items)
        return items

    b: Batched[int, int] = Batched("testing", run, lanes=1, linger=0.05)
    calls = [asyncio.create_task(b.call(i)) for i in range(5)]
    assert [await t for t in calls] == [0, 1, 2, 3, 4]
    assert batches == [[0, 1, 2, 3, 4]]
    # flush() does not wait out the linger (60 s here) and returns once served.
    b = Batched("testing", run, lanes=1, linger=60.0)
    late = asyncio.create_task(b.call(5))
    await asyncio.sleep(0)  # the call is queued
    await asyncio.wait_for(b.flush(), 5)
    assert batches[-1] == [5]  # served by flush(), not after the linger
    assert await asyncio.wait_for(late, 1) == 5
