"""The mutating requests: DLQ replay and purge, schedule pause and resume.

Each runs only after :meth:`Guard.authorize` (token, CSRF, operator, reason)
and leaves audit rows: replay and purge through :mod:`duebox.dlq`, which
writes one per job; pause and resume here, in the same transaction as the
change.  The browser is then redirected (POST/redirect/GET) to a page that
shows the outcome once.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from duebox import dlq
from duebox.errors import ValidationError
from duebox.ids import parse_job_id, uuid7
from duebox.schedules.api import ScheduleInfo
from duebox.tables import audit

from .context import Dashboard
from .web import ID, REF, Request, Response, redirect, route

MAX_RATE = 1000.0


def _rate(request: Request) -> float:
    raw = request.form.get("rate", "10") or "10"
    try:
        rate = float(raw)
    except ValueError:
        raise ValidationError("rate", "must be a number of jobs per second", raw) from None
    if not 0 < rate <= MAX_RATE:
        raise ValidationError("rate", f"must be > 0 and at most {MAX_RATE:g} jobs per second",
                              raw)
    return rate


def _replay_summary(report: dlq.ReplayReport) -> tuple[str, str]:
    text = f"replayed {report.replayed}"
    if report.refused:
        text += "; refused " + ", ".join(f"{n}: {why}" for why, n in report.refused.items())
    if report.last_due_at is not None:
        text += f"; the last one is due at {report.last_due_at:%H:%M:%S} UTC"
    return text, "ok" if report.replayed and not report.refused else "warn"


@route("POST", rf"/jobs/{ID}/replay")
def replay_job(d: Dashboard, request: Request, job_id: str) -> Response:
    operator, reason = d.guard.authorize(request)
    jid = parse_job_id(job_id, "job id")
    report = dlq.replay(d.app, operator=operator, reason=reason, ids=[jid], rate=_rate(request))
    return redirect(f"/jobs/{jid}?flash={d.flash(*_replay_summary(report))}")


@route("POST", rf"/jobs/{ID}/purge")
def purge_job(d: Dashboard, request: Request, job_id: str) -> Response:
    operator, reason = d.guard.authorize(request)
    jid = parse_job_id(job_id, "job id")
    n = dlq.purge(d.app, operator=operator, reason=reason, ids=[jid])
    return redirect(f"/dlq?flash={d.flash(f'purged {n} job(s)', 'ok' if n else 'warn')}")


def _scope(request: Request) -> dict[str, Any]:
    return {"error_class": request.form.get("error_class") or None,
            "task": request.form.get("task") or None}


@route("POST", r"/dlq/replay")
def replay_all(d: Dashboard, request: Request) -> Response:
    operator, reason = d.guard.authorize(request)
    report = dlq.replay(d.app, operator=operator, reason=reason, rate=_rate(request),
                        **_scope(request))
    return redirect(f"/dlq?flash={d.flash(*_replay_summary(report))}")


@route("POST", r"/dlq/purge")
def purge_all(d: Dashboard, request: Request) -> Response:
    operator, reason = d.guard.authorize(request)
    n = dlq.purge(d.app, operator=operator, reason=reason, **_scope(request))
    return redirect(f"/dlq?flash={d.flash(f'purged {n} job(s)', 'ok')}")


def _schedule_action(d: Dashboard, request: Request, ref: str, action: str) -> Response:
    operator, reason = d.guard.authorize(request)
    with Session(d.app.engine) as session, session.begin():
        info = d.app.schedules.get(session, ref)
        assert isinstance(info, ScheduleInfo)
        result = (d.app.schedules.pause(session, info.id) if action == "pause"
                  else d.app.schedules.resume(session, info.id))
        session.execute(audit.insert().values(
            id=uuid7(), at=d.now(), operator=operator, action=f"schedule_{action}",
            job_id=None, reason=reason,
            details={"schedule": info.name, "schedule_id": str(info.id), "via": "dashboard"}))
    if action == "pause":
        text = f"schedule {info.name} paused" if result else f"{info.name} was already paused"
    else:
        nxt = f"{result:%Y-%m-%d %H:%M:%S} UTC" if isinstance(result, datetime) else "none"
        text = f"schedule {info.name} resumed; next fire {nxt}"
    return redirect(f"/schedules/{info.id}?flash={d.flash(text)}")


@route("POST", rf"/schedules/{REF}/pause")
def pause_schedule(d: Dashboard, request: Request, ref: str) -> Response:
    return _schedule_action(d, request, ref, "pause")


@route("POST", rf"/schedules/{REF}/resume")
def resume_schedule(d: Dashboard, request: Request, ref: str) -> Response:
    return _schedule_action(d, request, ref, "resume")
