"""Waiting for a job's end: :meth:`Duebox.wait_for` and
:meth:`Duebox.wait_for_async`.

A job ends in a state it leaves only by an operator's hand (``SUCCEEDED``,
``DEAD``, ``CANCELLED``, ``EXPIRED``, or ``DELIVERED`` to a consumer of your
own: duebox's part is done).  The wait reads the job with
:meth:`Duebox.get_job` (one indexed read, in a transaction of its own each
time) every ``interval``, starting at 10 ms and doubling up to half a
second, so a short job is seen ending soon after it ends and a long one
costs two reads a second.  The timeout counts real time (the process's
monotonic clock), whatever clock the app decides due times with.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator

from ..errors import ValidationError, WaitTimeoutError
from .jobs import JobInfo

FIRST_INTERVAL = 0.01
LONGEST_INTERVAL = 0.5


def check_timeout(timeout: object) -> float:
    if (not isinstance(timeout, int | float) or isinstance(timeout, bool)
            or math.isnan(timeout) or not 0 < timeout <= 86_400 * 365):
        raise ValidationError("timeout", "must be a number of seconds > 0 (and at most a year)",
                              timeout)
    return float(timeout)


def _pauses(timeout: float) -> Iterator[float]:
    """The pauses between reads until ``timeout`` has passed (then it stops)."""
    deadline = time.monotonic() + timeout
    interval = FIRST_INTERVAL
    while (left := deadline - time.monotonic()) > 0:
        yield min(interval, left)
        interval = min(interval * 2, LONGEST_INTERVAL)


def wait(read: Callable[[], JobInfo], job_id: uuid.UUID | str, timeout: float) -> JobInfo:
    """Read the job until it ended; :class:`WaitTimeoutError` after ``timeout`` s."""
    info = read()
    for pause in _pauses(timeout):
        if info.finished:
            return info
        time.sleep(pause)
        info = read()
    if info.finished:
        return info
    raise WaitTimeoutError(job_id, timeout, info)


async def wait_async(read: Callable[[], Awaitable[JobInfo]], job_id: uuid.UUID | str,
                     timeout: float) -> JobInfo:  # noqa: ASYNC109 - a deadline of reads
    """:func:`wait` for an event loop: ``read`` returns an awaitable."""
    info = await read()
    for pause in _pauses(timeout):
        if info.finished:
            return info
        await asyncio.sleep(pause)
        info = await read()
    if info.finished:
        return info
    raise WaitTimeoutError(job_id, timeout, info)
