"""Recurring schedules: the API behind ``app.schedules`` and ``duebox schedules``.

A schedule is a template, not a job.  The relay turns each of its fire times
into one occurrence job whose id is derived from ``(schedule_id,
nominal_fire_at)`` (see :mod:`duebox.schedules.occurrences`).  Like the producer API,
every method here takes the caller's ``Session``, ``Connection``,
``AsyncSession`` or ``AsyncConnection`` and never commits::

    with Session(engine) as s, s.begin():
        app.schedules.add(s, "nightly-report", "report.build", "30 2 * * *",
                          timezone="Europe/Berlin", misfire="fire_once")

Defaults: misfire ``fire_once``, overlap ``allow``, DST gap ``shift`` and fold
``first`` (docs/schedules.md has the table of what each does).
"""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, overload

from sqlalchemy import Row, delete, select, update

from ..db import insert_if_absent
from ..errors import ValidationError
from ..ids import uuid7
from ..producer import (
    Steps,
    Target,
    cancel_steps,
    check_payload,
    check_priority,
    dialect_of,
    drive,
)
from ..registry import check_queue_name
from ..states import JobState
from ..tables import job, schedule
from ..targets import AsyncTarget, SyncTarget
from ..validation import check_optional_str, seconds_of
from .cron import (
    DEFAULT_FOLD,
    DEFAULT_GAP,
    FOLD_POLICIES,
    GAP_POLICIES,
    Fire,
    Rule,
    check_policy,
)
from .put import PutResult, put_steps
from .rows import (
    ScheduleInfo,
    ScheduleNotFoundError,
    audit_steps,
    check_who,
    get_steps,
)

if TYPE_CHECKING:
    from ..clock import Clock
    from ..config import Settings
    from ..tasks import Task


class _App(Protocol):
    """What schedules use of the application (``Duebox``, which owns them:
    typed by shape so this module need not import it)."""

    settings: Settings

    @property
    def clock(self) -> Clock: ...

    def get_task(self, name: str) -> Task: ...

    def payload_limit(self) -> tuple[int, str]: ...

MISFIRE_POLICIES = ("fire_once", "fire_all", "skip")
OVERLAP_POLICIES = ("allow", "skip", "queue")
DEFAULT_MISFIRE = "fire_once"
DEFAULT_OVERLAP = "allow"
MAX_JITTER = 86_400
# expire_after is stored in a 32-bit column.
MAX_EXPIRE_AFTER = 2**31 - 1
# Occurrences that were generated but not yet handed to a worker.  Deleting a
# schedule keeps them (like pausing it) unless asked to cancel them (a
# message already in a broker is then discarded by the worker's version
# check).
PENDING_STATES = (JobState.SCHEDULED, JobState.DISPATCHING, JobState.ENQUEUED)
# The keyword arguments of add and put, for validate.
_OPTIONS = frozenset({"timezone", "payload", "queue", "jitter", "misfire", "overlap", "gap",
                      "fold", "priority", "expire_after", "paused"})


# --- validation -------------------------------------------------------------


def _seconds(field: str, value: object, *, minimum: int, maximum: int) -> int:
    seconds = seconds_of(field, value)
    if seconds != int(seconds) or not minimum <= seconds <= maximum:
        raise ValidationError(field, f"must be a whole number of seconds from {minimum} to "
                              f"{maximum}", value)
    return int(seconds)


@dataclass(frozen=True)
class DeleteResult:
    """What deleting a schedule did to the occurrences it had generated and
    that had not started: ``cancelled`` (with ``cancel_pending``) or ``kept``
    (they still run)."""

    cancelled: int
    kept: int


# --- statements ---------------------------------------------------------------


def _add_steps(values: dict[str, Any], dialect: str) -> Steps[uuid.UUID]:
    result = yield insert_if_absent(schedule, values, dialect, ["name"])
    if result.rowcount != 1:
        raise ValidationError("name", "a schedule with this name already exists "
                              "(app.schedules.put or `duebox schedules add --update` updates "
                              "it)", values["name"])
    return uuid.UUID(str(values["id"]))


def _list_steps(include_paused: bool) -> Steps[list[ScheduleInfo]]:
    stmt = select(schedule).order_by(schedule.c.name)
    if not include_paused:
        stmt = stmt.where(schedule.c.paused.is_(False))
    result = yield stmt
    return [ScheduleInfo.from_row(r) for r in result.all()]


def _pause_steps(ref: object, now: datetime, who: tuple[str, str] | None) -> Steps[bool]:
    info = yield from get_steps(ref)
    result = yield (update(schedule).where(schedule.c.id == info.id, schedule.c.paused.is_(False))
                    .values(paused=True, version=schedule.c.version + 1, updated_at=now))
    if result.rowcount != 1:
        return False
    yield from audit_steps(now, who, "pause", info)
    return True


def _resume_steps(ref: object, now: datetime, who: tuple[str, str] | None
                  ) -> Steps[datetime | None]:
    info = yield from get_steps(ref)
    if not info.paused:
        return info.next_fire_at
    # What would have fired while paused is not a misfire: start afresh.
    nxt = info.rule.next_after(now)
    at = nxt.at if nxt else None
    result = yield (update(schedule).where(schedule.c.id == info.id, schedule.c.paused.is_(True))
                    .values(paused=False, next_fire_at=at, version=schedule.c.version + 1,
                            updated_at=now, retired_at=None))
    if result.rowcount == 1:
        yield from audit_steps(now, who, "resume", info,
                          next_fire_at=at.isoformat() if at else None)
    return at


def _delete_steps(ref: object, now: datetime, cancel_pending: bool,
                  who: tuple[str, str] | None) -> Steps[DeleteResult]:
    info = yield from get_steps(ref)
    found = yield (select(job.c.id).where(job.c.schedule_id == info.id,
                                          job.c.state.in_(list(PENDING_STATES)))
                   .order_by(job.c.due_at))
    pending = [row[0] for row in found.all()]
    cancelled = 0
    if cancel_pending:
        operator, reason = who if who is not None else (None, None)
        for job_id in pending:
            # One fenced cancel (and, from an operator, one audit row) per
            # occurrence, so `duebox jobs show` says why it did not run.
            done = yield from cancel_steps(
                job_id, now, operator, reason, PENDING_STATES,
                {"schedule": info.name, "schedule_id": str(info.id), "by": "schedule_delete"})
            cancelled += done
    result = yield delete(schedule).where(schedule.c.id == info.id)
    if result.rowcount != 1:
        raise ScheduleNotFoundError(ref)  # deleted meanwhile by someone else
    outcome = DeleteResult(cancelled=cancelled, kept=0 if cancel_pending else len(pending))
    yield from audit_steps(now, who, "delete", info, task=info.task, cron=info.cron,
                      timezone=info.timezone, cancelled=outcome.cancelled, kept=outcome.kept)
    return outcome


def _history_steps(ref: object, limit: int) -> Steps[list[Row[Any]]]:
    info = yield from get_steps(ref)
    result = yield (
        select(job.c.id, job.c.nominal_fire_at, job.c.due_at, job.c.state, job.c.attempt)
        .where(job.c.schedule_id == info.id)
        .order_by(job.c.nominal_fire_at.desc()).limit(limit)
    )
    return list(result.all())


# --- the API ------------------------------------------------------------------


class Schedules:
    """``app.schedules``: add, inspect, pause, resume and delete schedules."""

    def __init__(self, app: _App) -> None:
        self._app = app

    # Each method returns its result for a sync target and a coroutine for an
    # async one (see duebox.targets); the overloads say which to a type checker.

    @overload
    def add(
        self, session: SyncTarget, name: str, task: str, cron: str, *,
        timezone: str = "UTC", payload: Any = None, queue: str | None = None,
        jitter: int | timedelta = 0, misfire: str = DEFAULT_MISFIRE,
        overlap: str = DEFAULT_OVERLAP, gap: str = DEFAULT_GAP, fold: str = DEFAULT_FOLD,
        priority: int = 0, expire_after: int | timedelta | None = None, paused: bool = False,
    ) -> uuid.UUID: ...

    @overload
    def add(
        self, session: AsyncTarget, name: str, task: str, cron: str, *,
        timezone: str = "UTC", payload: Any = None, queue: str | None = None,
        jitter: int | timedelta = 0, misfire: str = DEFAULT_MISFIRE,
        overlap: str = DEFAULT_OVERLAP, gap: str = DEFAULT_GAP, fold: str = DEFAULT_FOLD,
        priority: int = 0, expire_after: int | timedelta | None = None, paused: bool = False,
    ) -> Coroutine[Any, Any, uuid.UUID]: ...

    def add(
        self,
        session: Target,
        name: str,
        task: str,
        cron: str,
        *,
        timezone: str = "UTC",
        payload: Any = None,
        queue: str | None = None,
        jitter: int | timedelta = 0,
        misfire: str = DEFAULT_MISFIRE,
        overlap: str = DEFAULT_OVERLAP,
        gap: str = DEFAULT_GAP,
        fold: str = DEFAULT_FOLD,
        priority: int = 0,
        expire_after: int | timedelta | None = None,
        paused: bool = False,
    ) -> uuid.UUID | Awaitable[uuid.UUID]:
        """Create a schedule; returns its id.  Never commits.

        ``cron`` has 5 fields (minute first) or 6 (second first), evaluated in
        ``timezone`` (IANA).  ``jitter`` delays each occurrence by a fixed
        pseudo-random 0..jitter seconds (never earlier).  ``misfire`` says what
        happens to fire times missed during an outage (``fire_once``,
        ``fire_all``, ``skip``); ``overlap`` what happens when the previous
        occurrence is still active (``allow``, ``skip``, ``queue``); ``gap`` and
        ``fold`` resolve wall times that daylight saving time removes
        (``shift``, ``skip``) or repeats (``first``, ``last``, ``both``).
        ``expire_after`` makes each occurrence EXPIRED, never run, when it
        could not start within that many seconds of its due time.
        """
        dialect = dialect_of(session)
        values = self.validate(
            name, task, cron, timezone=timezone, payload=payload, queue=queue, jitter=jitter,
            misfire=misfire, overlap=overlap, gap=gap, fold=fold, priority=priority,
            expire_after=expire_after, paused=paused,
        )
        return drive(session, _add_steps(values, dialect))

    @overload
    def put(
        self, session: SyncTarget, name: str, task: str, cron: str, *,
        timezone: str = "UTC", payload: Any = None, queue: str | None = None,
        jitter: int | timedelta = 0, misfire: str = DEFAULT_MISFIRE,
        overlap: str = DEFAULT_OVERLAP, gap: str = DEFAULT_GAP, fold: str = DEFAULT_FOLD,
        priority: int = 0, expire_after: int | timedelta | None = None, paused: bool = False,
        operator: str | None = None, reason: str | None = None,
    ) -> PutResult: ...

    @overload
    def put(
        self, session: AsyncTarget, name: str, task: str, cron: str, *,
        timezone: str = "UTC", payload: Any = None, queue: str | None = None,
        jitter: int | timedelta = 0, misfire: str = DEFAULT_MISFIRE,
        overlap: str = DEFAULT_OVERLAP, gap: str = DEFAULT_GAP, fold: str = DEFAULT_FOLD,
        priority: int = 0, expire_after: int | timedelta | None = None, paused: bool = False,
        operator: str | None = None, reason: str | None = None,
    ) -> Coroutine[Any, Any, PutResult]: ...

    def put(
        self, session: Target, name: str, task: str, cron: str, *,
        operator: str | None = None, reason: str | None = None, **options: Any,
    ) -> PutResult | Awaitable[PutResult]:
        """Create schedule ``name`` or make it match these arguments (those of
        :meth:`add`); never commits.  Nothing changed: no write, the version
        stays.  Something changed: the version goes up by one, and the next
        fire time is recomputed from now if the rule (cron, zone, gap, fold)
        changed.  ``paused`` applies only when put creates the schedule: a
        pause or resume stays as an operator left it.  With ``operator`` (and
        a ``reason``) a change writes an audit row (``schedule_add`` or
        ``schedule_update``, naming each changed setting).  See
        :class:`duebox.schedules.put.PutResult` for what it returns."""
        dialect = dialect_of(session)
        who = check_who(operator, reason)
        values = self.validate(name, task, cron, **options)
        return drive(session, put_steps(values, dialect, self._app.clock.now(), who))

    def validate(self, name: object, task: object, cron: object, **options: Any
                 ) -> dict[str, Any]:
        """Check every argument of :meth:`add` (naming the field at fault) and
        return the row to insert."""
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) for a schedule: {unknown}")
        check_optional_str("name", name, 200)
        if name is None:
            raise ValidationError("name", "must be a non-empty string", name)
        if not isinstance(task, str):
            raise ValidationError("task", "must be a registered task name", task)
        registered = self._app.get_task(task)  # a name with NUL is never registered
        queue = options.get("queue")
        check_optional_str("queue", queue, 200)
        if queue is not None:
            check_queue_name(self._app.settings.broker_url, queue)
        rule = Rule(cron, options.get("timezone", "UTC"),  # type: ignore[arg-type]
                    gap=options.get("gap", DEFAULT_GAP), fold=options.get("fold", DEFAULT_FOLD))
        misfire = check_policy("misfire", options.get("misfire", DEFAULT_MISFIRE),
                               MISFIRE_POLICIES)
        overlap = check_policy("overlap", options.get("overlap", DEFAULT_OVERLAP),
                               OVERLAP_POLICIES)
        jitter = _seconds("jitter", options.get("jitter", 0), minimum=0, maximum=MAX_JITTER)
        expire = options.get("expire_after")
        expire_after = None if expire is None else _seconds("expire_after", expire, minimum=1,
                                                            maximum=MAX_EXPIRE_AFTER)
        payload = options.get("payload")
        check_payload(payload, self._app.payload_limit())
        priority = check_priority(options.get("priority", 0))
        paused = options.get("paused", False)
        if not isinstance(paused, bool):
            raise ValidationError("paused", "must be True or False", paused)
        now = self._app.clock.now()
        first = rule.next_after(now)
        if first is None:
            raise ValidationError("cron", "never fires (no matching time in the next 50 years)",
                                  cron)
        return {
            "id": uuid7(), "name": name, "task": task, "queue": queue or registered.queue,
            "cron": rule.cron, "timezone": rule.timezone, "payload": payload,
            "next_fire_at": first.at, "last_fire_at": None, "misfire_policy": misfire,
            "overlap_policy": overlap, "gap_policy": rule.gap, "fold_policy": rule.fold,
            "jitter_seconds": jitter, "priority": priority,
            "max_attempts": registered.max_attempts, "expire_after_seconds": expire_after,
            "version": 1, "paused": paused, "created_at": now, "updated_at": now,
        }

    @overload
    def get(self, session: SyncTarget, ref: uuid.UUID | str) -> ScheduleInfo: ...

    @overload
    def get(self, session: AsyncTarget, ref: uuid.UUID | str
            ) -> Coroutine[Any, Any, ScheduleInfo]: ...

    def get(self, session: Target, ref: uuid.UUID | str
            ) -> ScheduleInfo | Awaitable[ScheduleInfo]:
        """A schedule by id or name; :class:`ScheduleNotFoundError` if none."""
        dialect_of(session)
        return drive(session, get_steps(ref))

    @overload
    def list(self, session: SyncTarget, *, include_paused: bool = True
             ) -> builtins.list[ScheduleInfo]: ...

    @overload
    def list(self, session: AsyncTarget, *, include_paused: bool = True
             ) -> Coroutine[Any, Any, builtins.list[ScheduleInfo]]: ...

    def list(self, session: Target, *, include_paused: bool = True
             ) -> builtins.list[ScheduleInfo] | Awaitable[builtins.list[ScheduleInfo]]:
        """Every schedule, by name."""
        dialect_of(session)
        return drive(session, _list_steps(include_paused))

    @overload
    def pause(self, session: SyncTarget, ref: uuid.UUID | str, *, operator: str | None = None,
              reason: str | None = None) -> bool: ...

    @overload
    def pause(self, session: AsyncTarget, ref: uuid.UUID | str, *,
              operator: str | None = None, reason: str | None = None
              ) -> Coroutine[Any, Any, bool]: ...

    def pause(self, session: Target, ref: uuid.UUID | str, *, operator: str | None = None,
              reason: str | None = None) -> bool | Awaitable[bool]:
        """Stop generating occurrences; True if it was running.  Occurrences
        already generated (at most a poll interval ahead) are left alone.

        With ``operator`` (and then a ``reason``, required) the change writes
        an audit row ``schedule_pause`` in the same transaction, as
        :meth:`Duebox.cancel` does; so do :meth:`resume` and :meth:`delete`."""
        dialect_of(session)
        who = check_who(operator, reason)
        return drive(session, _pause_steps(ref, self._app.clock.now(), who))

    @overload
    def resume(self, session: SyncTarget, ref: uuid.UUID | str, *,
               operator: str | None = None, reason: str | None = None) -> datetime | None: ...

    @overload
    def resume(self, session: AsyncTarget, ref: uuid.UUID | str, *,
               operator: str | None = None, reason: str | None = None
               ) -> Coroutine[Any, Any, datetime | None]: ...

    def resume(self, session: Target, ref: uuid.UUID | str, *, operator: str | None = None,
               reason: str | None = None) -> datetime | Awaitable[datetime | None] | None:
        """Generate again from the next fire time after now (what fell in the
        pause is not fired); returns that time."""
        dialect_of(session)
        who = check_who(operator, reason)
        return drive(session, _resume_steps(ref, self._app.clock.now(), who))

    @overload
    def delete(self, session: SyncTarget, ref: uuid.UUID | str, *, cancel_pending: bool = False,
               operator: str | None = None, reason: str | None = None) -> DeleteResult: ...

    @overload
    def delete(self, session: AsyncTarget, ref: uuid.UUID | str, *,
               cancel_pending: bool = False, operator: str | None = None,
               reason: str | None = None) -> Coroutine[Any, Any, DeleteResult]: ...

    def delete(self, session: Target, ref: uuid.UUID | str, *, cancel_pending: bool = False,
               operator: str | None = None, reason: str | None = None
               ) -> DeleteResult | Awaitable[DeleteResult]:
        """Delete a schedule.  Occurrences it already generated that have not
        started are kept and still run, as after :meth:`pause`, unless
        ``cancel_pending``: then each is cancelled (with an operator, each
        gets a ``cancel`` audit row naming the schedule).  The result counts
        both."""
        dialect_of(session)
        if not isinstance(cancel_pending, bool):
            raise ValidationError("cancel_pending", "must be True or False", cancel_pending)
        who = check_who(operator, reason)
        return drive(session, _delete_steps(ref, self._app.clock.now(), cancel_pending, who))

    @overload
    def history(self, session: SyncTarget, ref: uuid.UUID | str, limit: int = 10
                ) -> builtins.list[Row[Any]]: ...

    @overload
    def history(self, session: AsyncTarget, ref: uuid.UUID | str, limit: int = 10
                ) -> Coroutine[Any, Any, builtins.list[Row[Any]]]: ...

    def history(self, session: Target, ref: uuid.UUID | str, limit: int = 10
                ) -> builtins.list[Row[Any]] | Awaitable[builtins.list[Row[Any]]]:
        """The latest occurrences (id, nominal_fire_at, due_at, state, attempt)."""
        dialect_of(session)
        return drive(session, _history_steps(ref, limit))

    def next_fires(self, info: ScheduleInfo | Rule, n: int = 10,
                   after: datetime | None = None) -> builtins.list[Fire]:
        """The next ``n`` nominal fire times after ``after`` (default: now)."""
        rule = info.rule if isinstance(info, ScheduleInfo) else info
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 10_000:
            raise ValidationError("n", "must be an integer from 1 to 10000", n)
        return rule.upcoming(after or self._app.clock.now(), n)


__all__ = [
    "FOLD_POLICIES",
    "GAP_POLICIES",
    "MISFIRE_POLICIES",
    "OVERLAP_POLICIES",
    "DeleteResult",
    "PutResult",
    "ScheduleInfo",
    "ScheduleNotFoundError",
    "Schedules",
]
