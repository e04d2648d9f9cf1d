"""Read-only views of jobs for ``duebox jobs`` and ``duebox status``."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select

from duebox.db import db_errors
from duebox.errors import JobNotFoundError
from duebox.states import JobState
from duebox.tables import attempt, audit, job


def list_jobs(engine: Engine, state: str | None, queue: str | None, limit: int) -> list[Any]:
    stmt = select(job.c.id, job.c.task, job.c.state, job.c.due_at, job.c.attempt,
                  job.c.version, job.c.key)
    if state:
        stmt = stmt.where(job.c.state == state.upper())
    if queue:
        stmt = stmt.where(job.c.queue == queue)
    stmt = stmt.order_by(job.c.due_at.desc()).limit(limit)
    with db_errors("jobs list"), engine.connect() as conn:
        return list(conn.execute(stmt).all())


def _fmt(ts: datetime | None) -> str:
    return ts.isoformat(timespec="milliseconds") if ts else "-"


def where_now(row: Any, broker_scheme: str, now: datetime) -> str:
    state = row.state
    if state == JobState.SCHEDULED:
        wait = (row.due_at - now).total_seconds()
        if wait > 0:
            return f"parked in the database, due in {wait:.1f} s"
        return f"in the database, due {-wait:.1f} s ago, waiting to be claimed"
    if state == JobState.DISPATCHING:
        return f"claimed by relay {row.lease_owner}, lease until {_fmt(row.lease_until)}"
    if state == JobState.ENQUEUED:
        mid = f" as message {row.broker_message_id}" if row.broker_message_id else ""
        return f"in the {broker_scheme} broker{mid}, handed over {_fmt(row.published_at)}"
    if state == JobState.RUNNING:
        return f"running on {row.lease_owner}, lease until {_fmt(row.lease_until)}"
    return f"finished: {state}"


def show_job(engine: Engine, job_id: uuid.UUID, broker_scheme: str, now: datetime,
             with_payload: bool = False) -> str:
    with db_errors("jobs show"), engine.connect() as conn:
        row = conn.execute(select(job).where(job.c.id == job_id)).first()
        if row is None:
            raise JobNotFoundError(job_id)
        attempts = conn.execute(
            select(attempt).where(attempt.c.job_id == job_id).order_by(attempt.c.started_at)
        ).all()
        audits = conn.execute(
            select(audit).where(audit.c.job_id == job_id).order_by(audit.c.at)
        ).all()
    lines = [
        f"job {row.id}",
        f"  task {row.task}  queue {row.queue}  state {row.state}  version {row.version}  "
        f"attempt {row.attempt}/{row.max_attempts}",
    ]
    if row.key:
        lines.append(f"  key {row.key}")
    if row.tenant:
        lines.append(f"  tenant {row.tenant}  priority {row.priority}")
    lines.append(f"  now: {where_now(row, broker_scheme, now)}")
    if with_payload:
        lines.append(f"  payload {json.dumps(row.payload, sort_keys=True)[:2000]}")
    lines.append("timeline")
    events = [("created", row.created_at), ("due", row.due_at), ("claimed", row.claimed_at),
              ("enqueued", row.published_at), ("started", row.started_at),
              ("finished", row.finished_at)]
    for name, ts in events:
        if ts is None:
            continue
        note = ""
        if name in ("claimed", "enqueued", "started", "finished"):
            late = (ts - row.due_at).total_seconds() * 1000
            note = f"  ({late:+.1f} ms vs due)"
        lines.append(f"  {name:<9} {_fmt(ts)}{note}")
    if attempts:
        lines.append("attempts")
        for a in attempts:
            err = f"  {a.error_class}: {a.error}" if a.error_class else ""
            lines.append(f"  #{a.number} {a.outcome or 'running'} on {a.worker} "
                         f"started {_fmt(a.started_at)} finished {_fmt(a.finished_at)}{err}")
    if row.last_error:
        lines.append(f"last error ({row.error_class}): {row.last_error}")
    if audits:
        lines.append("audit")
        for a in audits:
            lines.append(f"  {_fmt(a.at)} {a.action} by {a.operator}: {a.reason}")
    return "\n".join(lines)
