"""The JSON API: the read side of every page as JSON (docs/dashboard.md,
"JSON API"), and ``/healthz``.

Each view reads through the same function as its page (:mod:`.reads`), so
the numbers, the masking of payloads and error text, and the checks of the
query are the page's; a list takes ``limit`` (1-200) where its page has a
fixed size.  A query field a view does not read is refused (400 naming
it), and so is every bad value: the router (:mod:`.routes`) answers both
as ``{"error": {"status", "message", "field"}}``.  Nothing here writes:
actions stay forms behind the operator token and CSRF field.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from duebox.masking import Masked
from duebox.metrics import seconds as elapsed
from duebox.reads.results import loaded
from duebox.schedules.api import ScheduleInfo
from duebox.schedules.cron import load_zone

from .context import Dashboard
from .reads import (
    WINDOW,
    database_trouble,
    next_fire,
    next_transition,
    page_limit,
    read_dlq,
    read_job,
    read_jobs,
    read_overview,
    read_processes,
    read_schedule,
    read_schedules,
    versions,
)
from .web import REF, Request, Response, json_response, route

LIST = ("limit",)  # what every list takes besides its filters


def _row(row: Any) -> dict[str, Any]:
    return dict(row._mapping)


def _fields(model: Any, *leaving_out: str) -> dict[str, Any]:
    """A read model's fields as an object, but for those that need masking."""
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if f.name not in leaving_out}


def _masking(m: Masked) -> dict[str, Any]:
    """How the payload and error text of one job or schedule are shown."""
    return {"payload": None if m.hidden else m.payload, "hidden": m.hidden, "note": m.note}


@route("GET", r"/api/overview", params=("ahead",))
def overview(d: Dashboard, request: Request) -> Response:
    o = read_overview(d, request.query)
    return json_response({
        "status": o.report.as_json(),
        "backend": d.scheme,
        "lateness": [{"start": b.start, "started": b.count, "p50_s": b.p50, "p99_s": b.p99}
                     for b in o.lateness],
        "coming_up": {"horizon": o.horizon, "slices": [
            {"start": b.start, "jobs": b.count, "capped": b.capped, "schedule_fires": f}
            for b, f in zip(o.due, o.fires, strict=True)]},
    })


@route("GET", r"/api/queues", params=())
def queues(d: Dashboard, request: Request) -> Response:
    report = read_overview(d, {}).report
    return json_response({"at": report.at, "window_s": WINDOW, "capped": report.capped,
                          "queues": report.queues, "tenants": report.tenants})


@route("GET", r"/api/jobs", params=("q", "queue", "state", "from", "to", "after", *LIST))
def jobs(d: Dashboard, request: Request) -> Response:
    found = read_jobs(d, request.query, page_limit(request.query, d.page_size))
    nxt = found.page.next
    return json_response({"jobs": [_row(r) for r in found.page.rows],
                          "next": None if nxt is None else nxt.encode()})


@route("GET", rf"/api/jobs/{REF}", params=())
def job(d: Dashboard, request: Request, ref: str) -> Response:
    shown = read_job(d, ref)
    detail, m = shown.detail, shown.mask
    return json_response({
        **_fields(detail.job, "payload", "last_error"),
        "where": shown.where,
        "last_error": m.text(detail.job.last_error),
        "masking": _masking(m),
        # A kept result (docs/results.md), masked like the payload.
        "result": (None if detail.result_text is None or m.hidden
                   else m.value(loaded(detail.result_text))),
        "has_result": detail.result_text is not None,
        "timeline": detail.timeline(),
        "attempts": [{**_fields(a), "error": m.text(a.error), "traceback": m.text(a.traceback)}
                     for a in detail.attempts],
        "versions": versions(detail),
        "audit": detail.audits,
    })


@route("GET", r"/api/dlq", params=("error_class", "task", "after", *LIST))
def dead_letters(d: Dashboard, request: Request) -> Response:
    dead = read_dlq(d, request.query, page_limit(request.query, d.page_size))
    return json_response({
        "total": dead.total, "error_class": dead.error_class, "task": dead.task,
        "jobs": [{**_fields(r, "last_error"), "error": dead.errors[r.id]}
                 for r in dead.rows],
        "next": None if dead.after is None else str(dead.after),
    })


def _schedule(info: ScheduleInfo) -> dict[str, Any]:
    """A schedule's facts, without its payload (masked apart)."""
    return _fields(info, "payload")


@route("GET", r"/api/schedules", params=("after", *LIST))
def schedules(d: Dashboard, request: Request) -> Response:
    infos, nxt = read_schedules(d, request.query, page_limit(request.query, d.page_size))
    return json_response({"schedules": [{**_schedule(i), "next_fire": next_fire(d, i)}
                                        for i in infos], "next": nxt})


@route("GET", rf"/api/schedules/{REF}", params=())
def schedule(d: Dashboard, request: Request, ref: str) -> Response:
    shown = read_schedule(d, ref)
    zone = load_zone(shown.info.timezone)
    change = next_transition(zone, d.now())
    return json_response({
        **_schedule(shown.info),
        "masking": _masking(shown.mask),
        "next_fires": [{"at": f.at, "local": f.at.astimezone(zone), "kind": f.kind,
                        "note": f.describe(zone)} for f in shown.fires],
        "next_clock_change": None if change is None else {
            "at": change, "from": (change - timedelta(seconds=1)).astimezone(zone).tzname(),
            "to": change.astimezone(zone).tzname()},
        "occurrences": [_row(r) for r in shown.recent],
        "operator_actions": [dataclasses.asdict(a) for a in shown.actions],
    })


@route("GET", r"/api/processes", params=())
def processes(d: Dashboard, request: Request) -> Response:
    seen = read_processes(d)
    now = seen.now
    return json_response({
        "processes": [{"role": p.role, "name": p.name, "info": p.info,
                       "heartbeat_age_s": elapsed(now, p.heartbeat_at) if p.heartbeat_at
                       else None,
                       "expires_in_s": (p.expires_at - now).total_seconds(),
                       "leased": seen.leased.get(p.name, {})} for p in seen.alive],
        "leases": [{**dataclasses.asdict(r), "expires_in_s": (r.expires_at - now).total_seconds()
                    if r.expires_at else None} for r in seen.leases],
    })


@route("GET", r"/healthz", params=())
def healthz(d: Dashboard, request: Request) -> Response:
    """200 while the database answers a read of duebox's job table, 503 with
    the reason otherwise (unreachable, no tables, no privilege): what a
    container's health check or a load balancer asks."""
    trouble = database_trouble(d)
    if trouble is not None:
        return json_response({"status": "unavailable", "database": trouble}, 503,
                             [("Retry-After", "5")])
    return json_response({"status": "ok", "database": "ok"})
