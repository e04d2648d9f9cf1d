"""Version-checked starts of delivered messages, several per transaction
when they queue up (duebox/batched_calls.py).

A message from a broker is only a hint: the job runs if its row still has
the message's version and a startable state (invariant 4).  A batch of
starts is one UPDATE over ``(id, version)`` pairs, rows locked in id order,
and one multi-row attempt insert.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from duebox.batched_calls import Batched
from duebox.db import db_errors
from duebox.leases import jobstore
from duebox.message import JobMessage
from duebox.states import Discard

from .execution import Pools

if TYPE_CHECKING:
    from duebox.app import Duebox

# The started job's record and None, or None and why it did not start.
Started = tuple[jobstore.JobRecord | None, Discard | None]
# Why to discard an early message, or None and its job's due time.
Checked = tuple[Discard | None, datetime | None]


class Starts:
    def __init__(self, app: Duebox, worker: str, pools: Pools) -> None:
        self.app = app
        self.worker = worker
        self._seq = itertools.count()
        self._batched: Batched[tuple[JobMessage, float], Started] = Batched(
            "starting", lambda batch: pools.db(self._start_batch, batch))
        self._checks: Batched[JobMessage, Checked] = Batched(
            "checking", lambda batch: pools.db(self._check_batch, batch))

    async def start(self, message: JobMessage, ahead: float) -> Started:
        """Start the message's job (``ahead``: seconds before its due time it
        may be); its leased record, or None and why not (``not_due``,
        ``stale_version``, ``cancelled``, ...)."""
        return await self._batched.call((message, ahead))

    async def check_early(self, message: JobMessage) -> Checked:
        """Before an early message is held or deferred: why to discard it, or
        None and its job's due time (see jobstore.check_early)."""
        return await self._checks.call(message)

    def _check_batch(self, batch: list[JobMessage]) -> list[Checked]:
        with db_errors("check"), self.app.engine.connect() as conn:
            return jobstore.check_early(conn, batch)

    def give_back(self, message: JobMessage) -> int:
        """See jobstore.give_back (runs in a thread)."""
        with db_errors("give back"), self.app.engine.begin() as conn:
            return jobstore.give_back(conn, job_id=message.job_id, version=message.version,
                                      now=self.app.clock.now())

    def _start_batch(self, batch: list[tuple[JobMessage, float]]) -> list[Started]:
        s = self.app.settings
        ahead = max(a for _, a in batch)
        with db_errors("start"), self.app.engine.begin() as conn:
            now = self.app.clock.now()
            started = jobstore.start_many(
                conn, messages=[m for m, _ in batch],
                owner=f"{self.worker}#{next(self._seq)}", now=now,
                lease_until=now + timedelta(seconds=s.lease_seconds + ahead),
                worker=self.worker, ahead=ahead)
            results: list[Started] = []
            for message, its_ahead in batch:
                rec = started.pop(message.job_id, None)
                if rec is not None:
                    results.append((rec, None))
                else:  # also a second copy of a message in the same batch
                    results.append((None, jobstore.why_not_started(
                        conn, message, now, now + timedelta(seconds=its_ahead))))
            return results
