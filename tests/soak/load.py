"""The load: jobs at a steady rate with delays from 0 to 1.5 x the broker's
ceiling, a tenth of them failing once or twice before they succeed, with
cancels and reschedules of jobs still waiting, and one recurring schedule.

Every call is one transaction that also writes the soak's plan row, so what
the verdict expects is exactly what was committed.  A transaction that fails
(a fault hit the database) is rolled back whole and the driver carries on.
"""

from __future__ import annotations

import collections
import random
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import duebox
from duebox import JobStateError
from tests.soak.app import EPOCH, SCHEDULE_CRON, SCHEDULE_NAME, plan

TICK = 0.2
FLAKY_SHARE = 0.10
CANCEL_SHARE = 0.04
RESCHEDULE_SHARE = 0.04


def us(dt: datetime) -> int:
    return (dt - EPOCH) // timedelta(microseconds=1)


class Driver:
    def __init__(self, app: duebox.Duebox, rng: random.Random, max_delay: float) -> None:
        self.app = app
        self.rng = rng
        self.spread = 1.5 * max_delay
        # Jobs that may still be waiting: candidates to cancel or reschedule.
        self.waiting: collections.deque[tuple[uuid.UUID, float]] = collections.deque()
        self.scheduled = 0
        self.cancelled = 0
        self.rescheduled = 0
        self.failed_tx = 0

    def add_schedule(self) -> None:
        with self.app.engine.begin() as conn:
            self.app.schedules.add(conn, SCHEDULE_NAME, "soak_recurring", SCHEDULE_CRON,
                                   overlap="allow")

    def pause_schedule(self) -> None:
        for _ in range(30):
            try:
                with self.app.engine.begin() as conn:
                    self.app.schedules.pause(conn, SCHEDULE_NAME)
                return
            except (sa.exc.DBAPIError, duebox.DatabaseError):
                time.sleep(1)  # a database fault is still on; try again
        raise RuntimeError("could not pause the soak's schedule")

    def run(self, seconds: float, jobs: int, interrupted: threading.Event) -> None:
        rate = jobs / seconds
        start = time.monotonic()
        owed = 0.0
        tick = 0
        while (elapsed := time.monotonic() - start) < seconds:
            if interrupted.is_set():
                raise KeyboardInterrupt("interrupted")
            owed = min(jobs, rate * elapsed) - self.scheduled
            if owed >= 1:
                self._guard(self._schedule, int(owed))
            self._meddle(int(rate * TICK))
            tick += 1
            time.sleep(max(0.0, start + tick * TICK - time.monotonic()))
        while self.scheduled < jobs and self.failed_tx < 1000:  # the last tick's remainder
            self._guard(self._schedule, jobs - self.scheduled)

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (sa.exc.DBAPIError, duebox.DatabaseError):
            self.failed_tx += 1

    def _schedule(self, n: int) -> None:
        new: list[tuple[str, Any]] = []
        for _ in range(n):
            if self.rng.random() < FLAKY_SHARE:
                new.append(("soak_flaky", {"fail": self.rng.choice((1, 2))}))
            else:
                new.append(("soak_plain", None))
        jobs = [self.app.new_job(task, payload, delay=self.rng.uniform(0, self.spread))
                for task, payload in new]
        with Session(self.app.engine) as s, s.begin():
            ids = self.app.schedule_many(s, jobs)
            assert isinstance(ids, list)
            s.execute(plan.insert(), [
                {"job_id": i, "kind": task.removeprefix("soak_"), "due_us": us(j.due_at),
                 "cancelled": False, "rescheduled": 0}
                for i, j, (task, _) in zip(ids, jobs, new, strict=True)])
        self.scheduled += n
        now = time.monotonic()
        for i, j in zip(ids, jobs, strict=True):
            self.waiting.append((i, now + (j.due_at - datetime.now(UTC)).total_seconds()))

    def _meddle(self, n: int) -> None:
        """Cancel and reschedule a few jobs that are probably still waiting."""
        now = time.monotonic()
        while self.waiting and self.waiting[0][1] < now:
            self.waiting.popleft()
        if len(self.waiting) < 10:
            return
        for _ in range(self._count(n * CANCEL_SHARE)):
            self._guard(self._cancel, self.rng.choice(self.waiting)[0])
        for _ in range(self._count(n * RESCHEDULE_SHARE)):
            self._guard(self._reschedule, self.rng.choice(self.waiting)[0])

    def _count(self, expected: float) -> int:
        whole = int(expected)
        return whole + (1 if self.rng.random() < expected - whole else 0)

    def _cancel(self, job_id: uuid.UUID) -> None:
        with self.app.engine.begin() as conn:
            if self.app.cancel(conn, job_id):
                conn.execute(plan.update().where(plan.c.job_id == job_id)
                             .values(cancelled=True))
                self.cancelled += 1

    def _reschedule(self, job_id: uuid.UUID) -> None:
        at = datetime.now(UTC) + timedelta(seconds=self.rng.uniform(0, self.spread))
        try:
            with self.app.engine.begin() as conn:
                self.app.reschedule(conn, job_id, at=at)
                conn.execute(plan.update().where(plan.c.job_id == job_id)
                             .values(due_us=us(at), rescheduled=plan.c.rescheduled + 1))
        except JobStateError:
            return  # already running or done: nothing changed
        self.rescheduled += 1
