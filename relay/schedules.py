"""The relay's schedules step: turn due fire times into occurrence jobs.

Every pass runs up to ``rounds`` bounded batches of
:func:`duebox.schedules.occurrences.generate_due` (one short transaction each, ``FOR
UPDATE SKIP LOCKED`` so any number of relays share the work).  Occurrences
are generated up to ``poll_interval + 1 s`` ahead of their fire time, so the
normal claim hands them to the broker with the remaining delay and they run
on time; a backlog (``fire_all`` after an outage) is spread over passes and
keeps the relay from sleeping until it is done.

On its first pass a relay first syncs the schedules declared in code
(:mod:`duebox.schedules.sync`), then logs what it found overdue: one-shot jobs past their
due time and schedules with missed fire times (the catch-up backlog).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import TYPE_CHECKING

from duebox.db import SQLITE_DEFERRED, db_errors
from duebox.schedules import occurrences
from duebox.schedules.sync import sync_declared

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")


class ScheduleStep:
    def __init__(self, app: Duebox, batch_size: int, *, rounds: int = 4,
                 process: str = "relay") -> None:
        self.app = app
        self.process = process
        self.batch_size = batch_size
        self.rounds = rounds
        # More occurrences are due than one pass generated: do not sleep.
        self.pending = False
        self.generated = 0
        self.errors = 0
        self._discovered = False
        self._synced = False

    @property
    def lookahead(self) -> float:
        return self.app.settings.poll_interval + 1.0

    async def run(self) -> int:
        """Generate due occurrences; returns how many were created."""
        if not self._synced:
            # A database error leaves it for the next pass; a declaration the
            # database refuses (ConfigurationError) ends the relay.
            await asyncio.to_thread(self._sync)
        if not self._discovered:
            await asyncio.to_thread(self._discover)
        created = 0
        self.pending = False
        if not await asyncio.to_thread(self._due):
            return 0
        for _ in range(self.rounds):
            result = await asyncio.to_thread(self._generate)
            created += result.occurrences
            self.errors += result.errors
            if not result.more:
                break
        else:
            self.pending = True
        self.generated += created
        return created

    def _due(self) -> bool:
        """Anything to generate?  A read on the (paused, next_fire_at) index
        that takes no write lock, so idle relays do not contend on SQLite."""
        horizon = self.app.clock.now() + timedelta(seconds=self.lookahead)
        reader = self.app.engine.execution_options(**{SQLITE_DEFERRED: True})
        with db_errors("schedules"), reader.connect() as conn:
            earliest = occurrences.earliest_due(conn)
        return earliest is not None and earliest <= horizon

    def _generate(self) -> occurrences.GenerateResult:
        s = self.app.settings
        with db_errors("schedules"), self.app.engine.begin() as conn:
            return occurrences.generate_due(
                conn, now=self.app.clock.now(), limit=self.batch_size,
                lookahead=self.lookahead, grace=s.misfire_grace, notify=s.notify,
            )

    def _sync(self) -> None:
        with db_errors("syncing the schedules declared in code"):
            sync_declared(self.app, f"relay {self.process}")
        self._synced = True

    def _discover(self) -> None:
        s = self.app.settings
        with db_errors("catch-up discovery"), self.app.engine.connect() as conn:
            jobs, schedules = occurrences.backlog(conn, self.app.clock.now(), s.catchup_after,
                                                  s.misfire_grace)
        self._discovered = True
        if jobs or schedules:
            log.warning(
                "catch-up: %d overdue jobs and %d schedules with missed fire times; "
                "releasing at most %g jobs/s, most urgent first", jobs, schedules,
                s.catchup_rate)
