"""What each page reads, once for both of its faces: the HTML view and the
JSON view (:mod:`.api`) of a page call the same function here, so they
show the same data, masked the same way, after the same checks of the
query.  Rendering is theirs; nothing here knows HTML or JSON."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, tzinfo
from typing import Any

from sqlalchemy import select

from duebox import dlq
from duebox.errors import DatabaseError, ValidationError
from duebox.ids import parse_job_id
from duebox.masking import Masked
from duebox.processes.heartbeat import alive
from duebox.reads.jobs import JobDetail, load_job, locator, payloads, where_now
from duebox.reads.pages import (
    PAGE_MAX,
    Cursor,
    DueBucket,
    JobFilter,
    JobPage,
    LatenessBucket,
    NamedLease,
    ScheduleAction,
    due_ahead,
    fires_ahead,
    in_flight_by_owner,
    lateness_buckets,
    named_leases,
    parse_filter,
    schedule_audit,
    schedules_page,
    search_jobs,
)
from duebox.reads.status import StatusReport, build_report
from duebox.schedules.api import ScheduleInfo
from duebox.schedules.cron import Fire
from duebox.tables import job

from .context import Dashboard

WINDOW = 300.0  # seconds of starts behind "throughput" (as in duebox status)
HORIZONS = {"5m": 300.0, "1h": 3600.0, "6h": 6 * 3600.0, "24h": 24 * 3600.0}
ERROR_CLASSES = ("transient", "throttled", "permanent", "unknown", "lost", "expired")


def page_limit(query: Mapping[str, str], default: int) -> int:
    """The ``limit`` field of a JSON list: rows per page, 1 to PAGE_MAX."""
    raw = query.get("limit", "").strip()
    if not raw:
        return default
    if not re.fullmatch(r"[0-9]{1,3}", raw) or not 1 <= int(raw) <= PAGE_MAX:
        raise ValidationError("limit", f"must be a whole number from 1 to {PAGE_MAX}", raw)
    return int(raw)


def database_trouble(d: Dashboard) -> str | None:
    """Why the database does not answer a read of duebox's job table
    (unreachable, no tables, no privilege); None when it does."""
    try:
        with d.read("dashboard health") as conn:
            conn.execute(select(job.c.id).limit(1)).all()
    except DatabaseError as exc:
        return str(exc)
    return None


# --- the overview ------------------------------------------------------------------------


@dataclass
class Overview:
    report: StatusReport
    horizon: str  # one of HORIZONS
    lateness: list[LatenessBucket]
    due: list[DueBucket]
    fires: list[int]  # schedule fire times per slice of ``due`` (not jobs yet)


def read_overview(d: Dashboard, query: Mapping[str, str]) -> Overview:
    horizon = query.get("ahead", "6h")
    if horizon not in HORIZONS:
        raise ValidationError("ahead", f"must be one of {', '.join(HORIZONS)}", horizon)
    now = d.now()
    report = build_report(d.app.engine, now, window=WINDOW,
                          own_queues=d.app.settings.own_queues)
    with d.read("dashboard overview") as conn:
        late = lateness_buckets(conn, now)
        ahead = due_ahead(conn, now, horizon=HORIZONS[horizon])
        fires = fires_ahead(conn, now, horizon=HORIZONS[horizon])
    return Overview(report, horizon, late, ahead, fires)


# --- jobs --------------------------------------------------------------------------------


@dataclass
class JobSearch:
    filter: JobFilter
    page: JobPage


def read_jobs(d: Dashboard, query: Mapping[str, str], limit: int) -> JobSearch:
    f = parse_filter(dict(query))
    after = Cursor.decode(query["after"]) if query.get("after") else None
    with d.read("dashboard jobs") as conn:
        return JobSearch(f, search_jobs(conn, f, limit=limit, after=after))


@dataclass
class ShownJob:
    """A job as people may see it: ``mask`` decides its payload and every
    error text (attempts, tracebacks, the last error)."""

    detail: JobDetail
    mask: Masked
    where: str  # where it is now, in words


# Audit actions that move a job's version on.
_VERSIONING = ("cancel", "reschedule", "replay")


@dataclass(frozen=True)
class VersionEvent:
    action: str  # "scheduled" (version 1), then cancel, reschedule or replay
    at: datetime
    operator: str | None


def versions(detail: JobDetail) -> list[VersionEvent]:
    """Version 1 is the job as scheduled; each audited cancel, reschedule or
    replay moved it on (a reschedule by the API writes no audit row, so the
    list may be shorter than the version number)."""
    return [VersionEvent("scheduled", detail.job.created_at, None)] + [
        VersionEvent(a.action, a.at, a.operator) for a in detail.audits
        if a.action in _VERSIONING]


def read_job(d: Dashboard, ref: str) -> ShownJob:
    detail = load_job(d.app.engine, parse_job_id(ref, "job id"))
    row = detail.job
    return ShownJob(detail, d.mask(row.task, row.payload),
                    where_now(row, locator(d.app), d.now()))


# --- the dead-letter queue ---------------------------------------------------------------


@dataclass
class DeadLetters:
    error_class: str | None
    task: str | None
    total: int
    rows: list[dlq.DeadJob]
    # Each row's error text as it may be shown (masked like its payload,
    # which it may quote); None: hidden (the job page says why).
    errors: dict[uuid.UUID, str | None]
    after: uuid.UUID | None  # where the next page starts; None: this is the last


def read_dlq(d: Dashboard, query: Mapping[str, str], limit: int) -> DeadLetters:
    error_class = query.get("error_class") or None
    if error_class is not None and error_class not in ERROR_CLASSES:
        raise ValidationError("error_class", f"must be one of {', '.join(ERROR_CLASSES)}",
                              error_class)
    task = query.get("task") or None
    after = query.get("after")
    with d.read("dashboard dlq") as conn:
        total = dlq.count_dead(conn, error_class=error_class, task=task)
        rows = dlq.list_dead(conn, error_class=error_class, task=task, limit=limit,
                             after=parse_job_id(after, "after") if after else None)
        raw = payloads(conn, [r.id for r in rows if not d.shown_as_is(r.task)])
    errors = {r.id: d.mask(r.task, raw[r.id]).text(r.last_error)
              if r.id in raw and r.last_error else r.last_error for r in rows}
    return DeadLetters(error_class, task, total, rows, errors,
                       rows[-1].id if len(rows) == limit else None)


# --- relays and workers ------------------------------------------------------------------


@dataclass
class Processes:
    now: datetime
    alive: list[Any]  # duebox.processes.heartbeat.ProcessRow
    leases: list[NamedLease]  # shards, schedule generation, ...
    leased: dict[str, dict[str, int]]  # jobs each process holds leased, by state


def read_processes(d: Dashboard) -> Processes:
    now = d.now()
    with d.read("dashboard processes") as conn:
        return Processes(now, alive(conn, now), named_leases(conn), in_flight_by_owner(conn))


# --- schedules ---------------------------------------------------------------------------


def next_transition(zone: tzinfo, after: datetime, days: int = 400) -> datetime | None:
    """The first instant after ``after`` at which ``zone``'s UTC offset
    changes (a daylight saving change), to the second; None within ``days``."""
    offset = after.astimezone(zone).utcoffset()
    lo = after
    for day in range(1, days + 1):
        hi = after + timedelta(days=day)
        if hi.astimezone(zone).utcoffset() != offset:
            while (hi - lo) > timedelta(seconds=1):
                mid = lo + (hi - lo) / 2
                if mid.astimezone(zone).utcoffset() == offset:
                    lo = mid
                else:
                    hi = mid
            return hi.replace(microsecond=0)
        lo = hi
    return None


def read_schedules(d: Dashboard, query: Mapping[str, str], limit: int
                   ) -> tuple[list[ScheduleInfo], str | None]:
    with d.read("dashboard schedules") as conn:
        return schedules_page(conn, after=query.get("after") or None, limit=limit)


def next_fire(d: Dashboard, info: ScheduleInfo) -> Fire | None:
    """The next fire of an active schedule (None when paused)."""
    fire = d.app.schedules.next_fires(info, 1)
    return fire[0] if fire and not info.paused else None


@dataclass
class ShownSchedule:
    info: ScheduleInfo
    mask: Masked
    fires: list[Fire]  # the next ten
    recent: list[Any]  # latest occurrences (jobs)
    actions: list[ScheduleAction]  # pause/resume, as audited


def read_schedule(d: Dashboard, ref: str) -> ShownSchedule:
    with d.read("dashboard schedule") as conn:
        info = d.app.schedules.get(conn, ref)
        assert isinstance(info, ScheduleInfo)
        recent = d.app.schedules.history(conn, info.id, 20)
        actions = schedule_audit(conn, info.id)
    assert isinstance(recent, list)
    return ShownSchedule(info, d.mask(info.task, info.payload),
                         d.app.schedules.next_fires(info, 10), recent, actions)
