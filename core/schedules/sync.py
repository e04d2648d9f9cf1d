"""Schedules as code: make the schedule table match ``@app.task(schedule=...)``.

Relays run :func:`sync_declared` once when they start.  For each declared
schedule (by name, in name order) one short transaction runs the upsert of
:mod:`duebox.schedules.put` with origin ``code``: created, updated (version
bumped, audit row) or left alone when nothing changed.  Then every ``code``
schedule no longer declared is retired per ``Settings.removed_schedules``:

* ``pause`` (the default): paused and marked ``retired_at``; its history
  stays, and declared again it resumes from the next fire time after now.
  A schedule an operator had paused stays theirs: the sync resumes only
  what it paused itself.
* ``delete``: deleted; occurrences it already generated still run.

Schedules made by hand (``app.schedules.add``/``put``, the CLI: origin
``api``) are never created, changed, paused or deleted here, even when a
declaration has the same name (that is logged once, and the hand-made one
wins).

Safe with several relays starting at once: each schedule's transaction locks
its row (``FOR UPDATE``), so concurrent syncs of the same code serialise on
it and all but the first find nothing to change; a deadlock between two of
them (InnoDB, racing inserts) rolls one back, which retries.  A relay that
loaded no tasks (started without ``--app``) declares nothing, and skips the
sync rather than retire every schedule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.exc import DBAPIError

from ..errors import ConfigurationError, ValidationError
from ..producer import Steps, drive_sync
from ..tables import schedule
from .put import CREATED, HAND_MADE, UPDATED, put_steps
from .rows import ORIGIN_CODE, ScheduleInfo, ScheduleNotFoundError, audit_steps

if TYPE_CHECKING:
    from ..clock import Clock
    from ..config import Settings
    from ..tasks import Task
    from .api import Schedules
    from .periodic import Periodic

log = logging.getLogger("duebox.schedules")

T = TypeVar("T")
# Tries per transaction when the database picks it as a deadlock victim.
_TRIES = 5
REASON = "declared in code (@app.task(schedule=...))"


class _App(Protocol):
    settings: Settings
    schedules: Schedules
    declared_schedules: dict[str, Periodic]
    tasks: dict[str, Task]

    @property
    def clock(self) -> Clock: ...

    @property
    def engine(self) -> Engine: ...


@dataclass
class SyncReport:
    """What one sync did, by schedule name."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    hand_made: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    skipped: bool = False

    @property
    def changes(self) -> int:
        return len(self.created) + len(self.updated) + len(self.paused) + len(self.deleted)


def _retryable(exc: DBAPIError) -> bool:
    """A deadlock or serialisation failure: the transaction may just be retried."""
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in ("40P01", "40001") or \
            getattr(orig, "pgcode", None) in ("40P01", "40001"):
        return True
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    return bool(args) and args[0] in (1213, 1205)  # InnoDB deadlock, lock wait timeout


def _in_transaction(engine: Engine, work: Callable[[Connection], T]) -> T:
    if engine.dialect.name in ("mysql", "mariadb"):
        # No gap locks on the absent name a first sync looks up (InnoDB's
        # REPEATABLE READ locks the gap, and racing inserts deadlock on it).
        engine = engine.execution_options(isolation_level="READ COMMITTED")
    for attempt in range(1, _TRIES + 1):
        try:
            with engine.begin() as conn:
                return work(conn)
        except DBAPIError as exc:
            if attempt == _TRIES or not _retryable(exc):
                raise
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def _retire_steps(info: ScheduleInfo, now: datetime, who: tuple[str, str]) -> Steps[bool]:
    result = yield (update(schedule)
                    .where(schedule.c.id == info.id, schedule.c.origin == ORIGIN_CODE,
                           schedule.c.paused.is_(False), schedule.c.retired_at.is_(None))
                    .values(paused=True, retired_at=now, version=schedule.c.version + 1,
                            updated_at=now))
    if result.rowcount != 1:
        return False
    yield from audit_steps(now, who, "pause", info, by="sync: no longer declared in code")
    return True


def sync_declared(app: _App, operator: str) -> SyncReport:
    """Sync the app's declared schedules into the database (see the module
    docstring); ``operator`` names the process in the audit rows.  A
    declaration the database refuses (a payload too large for the broker,
    an unusable queue) raises :class:`ConfigurationError` before any write."""
    report = SyncReport()
    if not app.tasks:
        report.skipped = True
        return report
    who = (operator, REASON)
    dialect = app.engine.dialect.name
    rows: list[dict[str, Any]] = []
    for name, p in sorted(app.declared_schedules.items()):
        try:
            rows.append(app.schedules.validate(name, p.task, p.cron, **p.options()))
        except ValidationError as exc:
            raise ConfigurationError(f"task {p.task!r}, schedule {name!r}: {exc}") from None
    for values in rows:
        def put(conn: Connection, values: dict[str, Any] = values) -> Any:
            return drive_sync(conn, put_steps(values, dialect, app.clock.now(), who,
                                         origin=ORIGIN_CODE))
        done = _in_transaction(app.engine, put)
        {CREATED: report.created, UPDATED: report.updated,
         HAND_MADE: report.hand_made}.get(done.outcome, report.unchanged).append(values["name"])
    for info in _gone(app):
        if app.settings.removed_schedules == "delete":
            def delete(conn: Connection, i: ScheduleInfo = info) -> object:
                return app.schedules.delete(conn, i.id, operator=who[0],
                                            reason="no longer declared in code")
            try:
                _in_transaction(app.engine, delete)
            except ScheduleNotFoundError:
                continue  # another relay's sync deleted it first
            report.deleted.append(info.name)
            continue

        def retire(conn: Connection, i: ScheduleInfo = info) -> bool:
            return drive_sync(conn, _retire_steps(i, app.clock.now(), who))
        if _in_transaction(app.engine, retire):
            report.paused.append(info.name)
    _log(report)
    return report


def _gone(app: _App) -> list[ScheduleInfo]:
    """The ``code`` schedules not declared now (with ``pause``, those not
    retired already)."""
    declared = set(app.declared_schedules)
    again = app.settings.removed_schedules == "delete"
    with app.engine.connect() as conn:
        found = conn.execute(select(schedule).where(schedule.c.origin == ORIGIN_CODE)
                             .order_by(schedule.c.name)).all()
    infos = [ScheduleInfo.from_row(r) for r in found]
    return [i for i in infos if i.name not in declared and (again or i.retired_at is None)]


def _log(report: SyncReport) -> None:
    for name in report.hand_made:
        log.warning("schedule %r is declared in code but was made by hand (CLI or "
                    "app.schedules): the hand-made one is kept; delete it to let the code "
                    "own it", name)
    if report.changes:
        parts = [f"{len(v)} {k} ({', '.join(v)})" for k, v in (
            ("created", report.created), ("updated", report.updated),
            ("paused", report.paused), ("deleted", report.deleted)) if v]
        log.info("schedules declared in code: %s", "; ".join(parts))


__all__ = ["REASON", "SyncReport", "sync_declared"]
