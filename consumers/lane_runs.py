"""The batch lane's transactions (consumers/lane.py), each in an executor
thread: a batch of due jobs locked, run and completed in one transaction,
on the group-commit machinery of consumers/group_commit.py.

- :meth:`LaneRuns.run_unstarted`: broker deliveries whose jobs were never
  started: their rows locked by ``(id, version)`` (core/unstarted.py
  ``lock_startable``), no start transaction before;
- :meth:`LaneRuns.run_claimed`: deliveries whose jobs their backend claimed
  (``sql://``): run as one group, their leases checked under its lock;
- :meth:`LaneRuns.run_due`: ``sql://`` with nothing delivered at all: the
  due rows themselves locked as a claim scans them (``lock_due``).  The
  jobs it may run are run; the others (a task not known to be short, an
  ordering key, an expired job, a payload stored undecodable) are leased in
  the same transaction, as the backend's claim would have, and handed back
  to be delivered the usual way.

A transaction lost as a whole (the connection, the commit) changed nothing
in the job table: every delivery then goes the usual way, and due rows are
simply locked again by the next batch; a handler that had run runs a second
time, counted (consumers/group_commit.py says when that can happen).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from duebox import claims, jobstore, tracing, unstarted
from duebox.db import bound_idle_transaction, db_errors
from duebox.message import ORDERING_KEY_HEADER, JobMessage, stored_payload_ok
from duebox.states import LeaseVerdict
from duebox.tasks import Task

from .execution import Outcome
from .group_commit import Executors, GroupItem

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.worker")

# One job the batch lane settled: its entry's index, record, outcome and
# handler start.
LaneResult = tuple[int, jobstore.JobRecord, Outcome, datetime]


@dataclass
class DueBatch:
    """What :meth:`LaneRuns.run_due` did: the jobs it settled (indexes into
    the rows it locked), the jobs it leased for the usual path, and how many
    rows it locked (as many as asked: more may be due)."""

    settled: list[LaneResult]
    leased: list[jobstore.JobRecord]
    locked: int


class LaneRuns:
    def __init__(self, app: Duebox, executors: Executors) -> None:
        self.app = app
        self.executors = executors

    def runnable(self, task: Task | None, headers: Mapping[str, object] | None) -> bool:
        """Whether a due job of ``task`` may run in the lane (see
        consumers/lane.py): group commit may run it, its handlers are known
        to be short, no ordering key, tracing off (the usual path makes the
        spans)."""
        return (task is not None and self.executors.groups(task) and self.executors.short(task)
                and (not headers or headers.get(ORDERING_KEY_HEADER) in (None, ""))
                and not tracing.enabled())

    def run_unstarted(self, entries: Sequence[tuple[JobMessage, Task]], owner: str
                      ) -> tuple[list[LaneResult], list[int]]:
        """Deliveries due now or within moments (consumers/lane.py holds
        early ones until LANE_LOCK_LEAD before their due time), in arrival
        order, whose jobs were never started: locked, run and completed in one
        transaction, with no start transaction before it (core/unstarted.py);
        a handler is held to its job's due time in this thread.  Returns what it settled
        and the indexes left unrun (the group's budget ran out); any other
        entry takes the worker's usual path."""
        ex, clock = self.executors, self.app.clock
        items: list[GroupItem] = []
        index: dict[int, int] = {}  # id(item) → its entry
        try:
            with db_errors("batch lane"), Session(self.app.engine) as session, session.begin():
                conn = session.connection()
                bound_idle_transaction(conn, self.app.settings.lease_seconds)
                now = clock.now()
                locked = unstarted.lock_startable(
                    conn, [m for m, _ in entries], now, owner,
                    due_by=max(m.due_at for m, _ in entries))
                for i, (message, task) in enumerate(entries):
                    # A second copy of a message, or a payload stored undecodable:
                    # the usual path (which discards or dead-letters it).
                    rec = locked.pop(message.job_id, None)
                    if rec is not None and stored_payload_ok(rec):
                        # Locked before its due time: the lock is its check,
                        # and its handler waits for the due time (_run_one).
                        items.append(GroupItem(task, rec, None, unstarted=True,
                                               early=rec.due_at > now))
                        index[id(items[-1])] = i
                if not items:
                    return [], []
                fresh = ex.dedupe.claim_many(conn, [str(i.rec.id) for i in items], clock.now())
                held = dict.fromkeys((i.rec.id for i in items), LeaseVerdict.HELD)
                done, unrun = ex.run_locked(session, conn, items, held, fresh)
        except BaseException as exc:
            self._lost(items, exc)
            raise
        return self._results(index, done), [index[id(item)] for item in unrun]

    def run_claimed(self, entries: Sequence[tuple[jobstore.JobRecord, Task, datetime | None]]
                    ) -> tuple[list[LaneResult], list[int]]:
        """Deliveries due now or within moments whose jobs their backend
        claimed (``sql://``): run as one group (their leases checked under the
        group's lock), a handler held to its job's due time in this thread."""
        now = self.app.clock.now()
        items = [GroupItem(task, rec, None, leased, early=rec.due_at > now)
                 for rec, task, leased in entries]
        try:
            done, unrun = self.executors.run_group(items)
        except BaseException as exc:
            self._lost(items, exc)
            raise
        index = {id(item): i for i, item in enumerate(items)}
        return self._results(index, done), [index[id(item)] for item in unrun]

    def run_due(self, queues: Sequence[str] | None, limit: int, owner: str,
                lease_owner: Callable[[], str]) -> DueBatch:
        """``sql://``: lock up to ``limit`` due jobs and run those the lane may
        run, in one transaction with no claim written for them; lease the rest
        to ``lease_owner()`` in it (see the module notes).  Rows locked and
        left unrun (the group's budget ran out) stay as they were: due, for
        the next batch."""
        ex, app = self.executors, self.app
        items: list[GroupItem] = []
        try:
            with db_errors("batch lane"), Session(app.engine) as session, session.begin():
                conn = session.connection()
                bound_idle_transaction(conn, app.settings.lease_seconds)
                now = app.clock.now()
                locked = unstarted.lock_due(conn, now=now, limit=limit, queues=queues,
                                            owner=owner)
                others: list[jobstore.JobRecord] = []
                for rec in locked:
                    task = app.tasks.get(rec.task)
                    if (task is not None and self.runnable(task, rec.headers)
                            and not rec.expired(now) and stored_payload_ok(rec)):
                        items.append(GroupItem(task, rec, None, unstarted=True))
                    else:
                        others.append(rec)
                leased = claims.claim_for_run(
                    conn, owner=lease_owner(), now=now, limit=len(others),
                    lease_until=now + timedelta(seconds=app.settings.lease_seconds),
                    queues=None, worker=ex.worker, ids=[r.id for r in others],
                ) if others else []
                done: list[tuple[GroupItem, Outcome]] = []
                if items:
                    fresh = ex.dedupe.claim_many(conn, [str(i.rec.id) for i in items],
                                                 app.clock.now())
                    held = dict.fromkeys((i.rec.id for i in items), LeaseVerdict.HELD)
                    done, _unrun = ex.run_locked(session, conn, items, held, fresh)
        except BaseException as exc:
            self._lost(items, exc)
            raise
        index = {id(item): i for i, item in enumerate(items)}
        return DueBatch(self._results(index, done), leased, len(locked))

    def _lost(self, items: list[GroupItem], exc: BaseException) -> None:
        """Rolled back as a whole: every delivery goes the usual way, so a
        handler that ran here runs a second time (see the module notes)."""
        ran = sum(item.ran for item in items)
        if ran:
            self.executors.on_rerun(ran)
            log.warning("a batch of %d jobs was rolled back after %d of its handlers ran "
                        "(%s): each runs again alone, those %d handlers a second time",
                        len(items), ran, exc, ran)

    def _results(self, index: dict[int, int], done: list[tuple[GroupItem, Outcome]]
                 ) -> list[LaneResult]:
        now = self.app.clock.now()
        return [(index[id(item)], item.rec, outcome, item.started or now)
                for item, outcome in done]


__all__ = ["DueBatch", "LaneResult", "LaneRuns"]
