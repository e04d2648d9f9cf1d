"""The dead-letter queue: a forensic record, and what can safely be done with it.

``DEAD`` jobs keep their id, payload and full attempt history.  Replay puts a
job back through the normal dispatch path (state ``SCHEDULED``, due times
spread at a capped rate, so a big replay is no thundering herd), keeps the job
id, bumps the version, gives it a fresh attempt budget, and writes an audit
row naming the operator and the reason.  Before that it checks the payload
still fits the task (``@app.task(validate=...)``).  A job that dies the same
way again after a replay is quarantined and refused by later replays unless
forced.  Purge deletes dead jobs and their attempts; the audit rows stay.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, delete, exists, select, update

from .db import db_errors
from .errors import ValidationError
from .failures import FailureClass, SystemFailure
from .ids import uuid7
from .states import JobState
from .tables import attempt, audit, job
from .validation import check_operator

if TYPE_CHECKING:
    from .app import Duebox

_PAGE = 500

Progress = Callable[[int], None]


@dataclass
class DeadJob:
    id: uuid.UUID
    task: str
    queue: str
    error_class: str | None
    last_error: str | None
    attempt: int
    finished_at: datetime | None
    quarantined: bool


@dataclass
class ReplayReport:
    replayed: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    last_due_at: datetime | None = None

    def refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1


def failure_signature(error_class: str, error: str | None) -> str:
    """How a failure is recognised as 'the same again': its class and the
    exception type that opens its message (not the message, which often
    carries ids or times)."""
    head = (error or "").split(":", 1)[0].strip()[:200]
    return f"{error_class}:{head}"


def quarantine_if_repeated(
    conn: Connection, job_id: uuid.UUID, error_class: str, error: str, now: datetime
) -> bool:
    """After a replay, a job that dies the same way again is quarantined: an
    audit row that makes replay refuse it unless forced."""
    last_replay = conn.execute(
        select(audit.c.details).where(audit.c.job_id == job_id, audit.c.action == "replay")
        .order_by(audit.c.at.desc()).limit(1)
    ).first()
    if last_replay is None:
        return False
    details = last_replay[0] or {}
    signature = failure_signature(error_class, error)
    if details.get("previous_failure") != signature:
        return False
    conn.execute(audit.insert().values(
        id=uuid7(), at=now, operator="duebox", action="quarantine", job_id=job_id,
        reason=f"failed the same way after replay ({signature})", details={"failure": signature},
    ))
    return True


# Replayed jobs are due 1/rate apart: slower than one per 1,000 s and a big
# replay's last due time would leave the calendar (duebox.validation.LATEST).
MIN_RATE = 0.001

# "refused": a publish the broker refuses for good (relay/refusals.py).
ERROR_CLASSES = (*(str(c) for c in FailureClass), *(str(c) for c in SystemFailure))


def check_error_class(error_class: object) -> str | None:
    """A filter on ``error_class`` must name one that exists: a typo would
    otherwise match nothing and report success ("replayed 0")."""
    if error_class is None:
        return None
    if error_class not in ERROR_CLASSES:
        raise ValidationError("error_class", f"must be one of {', '.join(ERROR_CLASSES)}",
                              error_class)
    return str(error_class)


def _quarantined() -> Any:
    return exists().where(audit.c.job_id == job.c.id, audit.c.action == "quarantine")


def list_dead(
    conn: Connection, *, error_class: str | None = None, task: str | None = None,
    limit: int = 50, after: uuid.UUID | None = None,
) -> list[DeadJob]:
    stmt = select(job.c.id, job.c.task, job.c.queue, job.c.error_class, job.c.last_error,
                  job.c.attempt, job.c.finished_at, _quarantined().label("q")
                  ).where(job.c.state == JobState.DEAD)
    if error_class:
        stmt = stmt.where(job.c.error_class == error_class)
    if task:
        stmt = stmt.where(job.c.task == task)
    if after is not None:
        stmt = stmt.where(job.c.id > after)
    rows = conn.execute(stmt.order_by(job.c.id).limit(limit)).all()
    return [_dead(row) for row in rows]


def _dead(row: Any) -> DeadJob:
    return DeadJob(id=row[0], task=row[1], queue=row[2], error_class=row[3], last_error=row[4],
                   attempt=row[5], finished_at=row[6], quarantined=bool(row[7]))


def _dead_pages(engine: Any, ids: Sequence[uuid.UUID] | None, error_class: str | None,
                task: str | None) -> Iterator[list[DeadJob]]:
    if ids is not None:
        for i in range(0, len(ids), _PAGE):
            chunk = list(ids[i:i + _PAGE])
            with engine.connect() as conn:
                rows = conn.execute(
                    select(job.c.id, job.c.task, job.c.queue, job.c.error_class,
                           job.c.last_error, job.c.attempt, job.c.finished_at,
                           _quarantined().label("q"))
                    .where(job.c.id.in_(chunk), job.c.state == JobState.DEAD)
                ).all()
            found = [_dead(r) for r in rows]
            missing = len(chunk) - len(found)
            yield found + [None] * missing  # type: ignore[list-item]
        return
    after = None
    while True:
        with engine.connect() as conn:
            page = list_dead(conn, error_class=error_class, task=task, limit=_PAGE, after=after)
        if not page:
            return
        yield page
        after = page[-1].id


def count_dead(conn: Connection, *, error_class: str | None = None,
               task: str | None = None) -> int:
    from sqlalchemy import func

    stmt = select(func.count()).select_from(job).where(job.c.state == JobState.DEAD)
    if error_class:
        stmt = stmt.where(job.c.error_class == error_class)
    if task:
        stmt = stmt.where(job.c.task == task)
    return int(conn.execute(stmt).scalar_one())


def replay(
    app: Duebox, *, operator: str, reason: str, ids: Sequence[uuid.UUID] | None = None,
    error_class: str | None = None, task: str | None = None, rate: float = 50.0,
    force: bool = False, progress: Progress | None = None,
) -> ReplayReport:
    """Send dead jobs back through dispatch at no more than ``rate`` per second.

    Raises :class:`ValidationError` without an operator and a reason, and
    :class:`PermissionDeniedError` when the database role may not do it."""
    operator, reason = check_operator(operator, reason)
    error_class = check_error_class(error_class)
    try:
        per_second = float(rate) if not isinstance(rate, bool) else math.nan
    except (TypeError, ValueError, OverflowError):  # not a number, or an int past any float
        per_second = math.nan
    if not isinstance(rate, int | float) or not math.isfinite(per_second) or not (
            per_second >= MIN_RATE):
        raise ValidationError("rate", f"must be a finite number of jobs per second >= {MIN_RATE}",
                              rate)
    rate = per_second
    with db_errors("dlq replay"):
        return _replay(app, operator, reason, ids, error_class, task, rate, force, progress)


def _replay(
    app: Duebox, operator: str, reason: str, ids: Sequence[uuid.UUID] | None,
    error_class: str | None, task: str | None, rate: float, force: bool,
    progress: Progress | None,
) -> ReplayReport:
    report = ReplayReport()
    start = app.clock.now()
    spacing = 1.0 / rate
    for page in _dead_pages(app.engine, ids, error_class, task):
        rows: list[tuple[DeadJob, int]] = []
        for dead in page:
            if dead is None:
                report.refuse("not dead")
                continue
            budget = _check_replayable(app, dead, force, report)
            if budget is not None:
                rows.append((dead, budget))
        with app.engine.begin() as conn:
            for dead, budget in rows:
                due = start + timedelta(seconds=report.replayed * spacing)
                moved = conn.execute(
                    update(job).where(job.c.id == dead.id, job.c.state == JobState.DEAD)
                    .values(state=JobState.SCHEDULED, due_at=due, version=job.c.version + 1,
                            max_attempts=job.c.attempt + budget, finished_at=None,
                            lease_owner=None, lease_until=None, updated_at=app.clock.now())
                ).rowcount
                if moved != 1:
                    report.refuse("not dead")
                    continue
                conn.execute(audit.insert().values(
                    id=uuid7(), at=app.clock.now(), operator=operator, action="replay",
                    job_id=dead.id, reason=reason,
                    details={"previous_failure": failure_signature(
                        dead.error_class or "unknown", dead.last_error),
                        "due_at": due.isoformat(), "forced": force},
                ))
                report.replayed += 1
                report.last_due_at = due
        if progress is not None:
            progress(len(page))
    return report


def _check_replayable(app: Duebox, dead: DeadJob, force: bool,
                      report: ReplayReport) -> int | None:
    if dead.quarantined and not force:
        report.refuse("quarantined (replay with force to override)")
        return None
    registered = app.tasks.get(dead.task)
    if registered is None:
        report.refuse(f"task {dead.task!r} is not registered (give --app)")
        return None
    if registered.validate is not None:
        with app.engine.connect() as conn:
            payload = conn.execute(select(job.c.payload).where(job.c.id == dead.id)).scalar()
        try:
            registered.validate(payload)
        except Exception as exc:
            report.refuse(f"payload no longer fits {dead.task!r}: {type(exc).__name__}")
            return None
    return registered.max_attempts


def purge(
    app: Duebox, *, operator: str, reason: str, ids: Sequence[uuid.UUID] | None = None,
    error_class: str | None = None, task: str | None = None,
    progress: Progress | None = None,
) -> int:
    """Delete dead jobs and their attempts; one audit row per job stays."""
    operator, reason = check_operator(operator, reason)
    error_class = check_error_class(error_class)
    with db_errors("dlq purge"):
        return _purge(app, operator, reason, ids, error_class, task, progress)


def _purge(
    app: Duebox, operator: str, reason: str, ids: Sequence[uuid.UUID] | None,
    error_class: str | None, task: str | None, progress: Progress | None,
) -> int:
    purged = 0
    for page in _dead_pages(app.engine, ids, error_class, task):
        dead_ids = [d.id for d in page if d is not None]
        if dead_ids:
            with app.engine.begin() as conn:
                gone = conn.execute(
                    delete(job).where(job.c.id.in_(dead_ids), job.c.state == JobState.DEAD)
                ).rowcount
                conn.execute(delete(attempt).where(attempt.c.job_id.in_(dead_ids)))
                now = app.clock.now()
                conn.execute(audit.insert(), [
                    {"id": uuid7(), "at": now, "operator": operator, "action": "purge",
                     "job_id": d.id, "reason": reason,
                     "details": {"task": d.task, "error_class": d.error_class}}
                    for d in page if d is not None
                ])
                purged += gone
        if progress is not None:
            progress(len(page))
    return purged
