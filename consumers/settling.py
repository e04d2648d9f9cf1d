"""A started job's end, written once a server takes writes again.

A failover (docs/scale.md, "PostgreSQL failover") cuts the transactions
under way: a job's own transaction — its handler's writes through
``ctx.session``, its dedupe row and its completion, committed together —
committed nothing, unless the commit itself was in flight, and then only
the job row on the new primary says whether it did.  The worker cannot
write the job's end while no server takes writes; a multi-host URL reaches
the promoted standby on the next connection, a fraction of a second later.
Without trying again the job would keep its lease, and run again only once
that ran out — a lease late (30 s by default).

So the worker tries the write again, with a short backoff, for as long as
the job's lease holds (:func:`until_written`) — and a delivery's start for
as long as it would otherwise have handed the delivery back to its broker
(:func:`until_answered`).  Every such write is fenced
by the lease (core/leases/jobstore.py): a late one, or one for a job whose commit
had gone through after all, matches no row and changes nothing.  Once the
lease is over the job is recovery's, as before.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from duebox.errors import DatabaseError
from duebox.observability.causes import cause_of

T = TypeVar("T")

# The first wait after a write found no server, doubled up to the most: the
# job is settled within MOST_WAIT of the server's return, without a burst of
# connection attempts from every cut job while it is away.
FIRST_WAIT = 0.05
MOST_WAIT = 0.5


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says the database is out
    of reach — the connection lost, no server taking writes — rather than
    refusing us for good or refusing the statement."""
    cause = cause_of(exc)
    return cause is not None and not cause.permanent


def until_written(write: Callable[[], T], held_until: Callable[[], float]) -> T:
    """``write()`` (a fenced write in a transaction of its own, raising
    :class:`DatabaseError` if it failed), tried again while it fails because
    the database is out of reach and ``held_until()`` (``time.monotonic()``
    seconds: when the job's lease runs out, as last renewed) is ahead.
    Any other error, and the last one, is raised."""
    pauses = _pauses(held_until)
    while True:
        try:
            return write()
        except DatabaseError as exc:
            pause = next(pauses, None)
            if pause is None or not unreachable(exc):
                raise
            time.sleep(pause)


async def until_answered(call: Callable[[], Awaitable[T]], within: float) -> T:
    """``await call()``, tried again while it fails because the database is
    out of reach, for at most ``within`` seconds: a delivery's start, which
    the worker otherwise hands back to its broker for a while (a failover
    would then cost each delivery in hand that while, not the outage)."""
    give_up = time.monotonic() + within
    pauses = _pauses(lambda: give_up)
    while True:
        try:
            return await call()
        except DatabaseError as exc:
            pause = next(pauses, None)
            if pause is None or not unreachable(exc):
                raise
            await asyncio.sleep(pause)


def _pauses(until: Callable[[], float]) -> Iterator[float]:
    """The waits between tries: from FIRST_WAIT, doubled up to MOST_WAIT,
    jittered, while ``until()`` (``time.monotonic()`` seconds) is ahead."""
    wait = FIRST_WAIT
    while (left := until() - time.monotonic()) > 0:
        yield min(left, wait * random.uniform(0.8, 1.0))
        wait = min(MOST_WAIT, wait * 2)


__all__ = ["FIRST_WAIT", "MOST_WAIT", "unreachable", "until_answered", "until_written"]
