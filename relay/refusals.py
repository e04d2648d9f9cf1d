"""What the relay does with the messages a broker would not take.

A broker that refuses a message for good (``PublishResult.permanent``: a
queue name it cannot use, a message over its size limit) will refuse it
every time.  Released and claimed again each pass, such a job looped for ever
with an empty ``last_error`` (issue #17: 40 claims in 8 s, "broker refused 2
of 2 messages", no reason).  Here a permanent refusal is a failed attempt of
the job: the broker's reason goes to ``last_error`` and an attempt row, the
job is tried again after its task's retry backoff with a new version, and
goes DEAD once its attempts are used up.  Any other refusal (a nack, no
confirm in time: the broker's trouble, not the job's) returns the job to
SCHEDULED with the reason in ``last_error``, to be published again next
pass.  Repeats are logged once per reason per interval.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

from duebox.brokers.base import PublishResult
from duebox.db import db_errors
from duebox.leases import dispatch_marks, jobstore
from duebox.observability.logs import CollapsedLog
from duebox.tasks import RetryPolicy

if TYPE_CHECKING:
    from duebox.app import Duebox


class Refusals:
    def __init__(self, app: Duebox, relay: str, log: CollapsedLog) -> None:
        self.app = app
        self.relay = relay
        self.log = log

    async def handle(self, records: list[jobstore.JobRecord], owner: str,
                     failed: list[PublishResult], sent: int) -> None:
        """Settle the claimed ``records`` whose results in ``failed`` say the
        broker did not take them (``sent``: the batch's size, for the log)."""
        by_reason: dict[tuple[str, bool], list[PublishResult]] = {}
        for r in failed:
            by_reason.setdefault((r.error or "no reason given", r.permanent), []).append(r)
        by_id = {rec.id: rec for rec in records}
        now = self.app.clock.now()
        refusals = []
        for (reason, permanent), results in by_reason.items():
            self.log.warning(
                f"refused:{permanent}:{reason[:80]}", "broker refused %d of %d messages: %s; %s",
                len(results), sent, reason, "each counts as a failed attempt of its job"
                if permanent else "they go back to SCHEDULED")
            if not permanent:
                await asyncio.to_thread(self._release, owner, [r.job_id for r in results],
                                        reason)
                continue
            for r in results:
                rec = by_id[r.job_id]
                task = self.app.tasks.get(rec.task)
                delay = (task.retry if task is not None else RetryPolicy()).delay(rec.attempt + 1)
                refusals.append(dispatch_marks.Refusal(rec, reason, now + timedelta(seconds=delay)))
        if refusals:
            await asyncio.to_thread(self._refuse, owner, refusals)

    def _release(self, owner: str, ids: list[uuid.UUID], reason: str) -> None:
        with db_errors("release"), self.app.engine.begin() as conn:
            dispatch_marks.release(conn, owner=owner, ids=ids, now=self.app.clock.now(),
                                   error=reason)

    def _refuse(self, owner: str, refusals: list[dispatch_marks.Refusal]) -> None:
        with db_errors("refuse"), self.app.engine.begin() as conn:
            dispatch_marks.refuse(conn, owner=owner, refusals=refusals, worker=self.relay,
                            now=self.app.clock.now())
