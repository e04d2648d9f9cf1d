"""Read-only views of jobs for ``duebox jobs`` and ``duebox status``."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select

from duebox.db import db_errors
from duebox.errors import JobNotFoundError
from duebox.states import JobState
from duebox.tables import attempt, audit, job
from duebox.values import shown


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
        return (f"{in_broker(row, broker_scheme, now)}{mid}, "
                f"handed over {_fmt(row.published_at)}")
    if state == JobState.RUNNING:
        return f"running on {row.lease_owner}, lease until {_fmt(row.lease_until)}"
    return f"finished: {state}"


def _amqp_tier(delay_ms: int, elapsed_ms: float) -> str:
    """The tier queue (level.digit) a message published ``elapsed_ms`` ago
    with a delay of ``delay_ms`` sits in: its stops run from the most
    significant digit down (duebox.brokers.amqp_topology)."""
    from duebox.brokers.amqp_topology import LEVELS, RADIX, tier_digits

    stops = [(LEVELS - 1 - i, d) for i, d in enumerate(tier_digits(delay_ms)) if d]
    passed = 0.0
    for n, (level, digit) in enumerate(stops, 1):
        passed += digit * RADIX**level
        if elapsed_ms < passed:
            return f"tier {level}.{digit:x} (stop {n} of {len(stops)})"
    return "its last tier"


def in_broker(row: Any, scheme: str, now: datetime) -> str:
    """Where an ENQUEUED job's message is, from the backend's delay mechanism
    and the delay it was published with."""
    wait = (row.due_at - now).total_seconds()
    due = f"due in {wait:.1f} s" if wait > 0 else "due, waiting for a worker"
    if scheme == "sqs":
        where = "in SQS delay (DelaySeconds)" if wait > 0 else "visible in the SQS queue"
    elif scheme == "amqp":
        where = f"in the RabbitMQ queue {row.queue}"
        if wait > 0 and row.published_at is not None:
            from duebox.brokers.amqp_topology import delay_ms

            ms = delay_ms((row.due_at - row.published_at).total_seconds())
            elapsed = (now - row.published_at).total_seconds() * 1000
            where = (f"in RabbitMQ delay {_amqp_tier(ms, elapsed)} (tier topology; with the "
                     f"delayed-message plugin, in its exchange)")
    elif scheme == "redis":
        where = ("in the Redis index (sorted set by due time)" if wait > 0
                 else f"in the Redis ready stream of {row.queue}")
    elif scheme == "kafka":
        where = f"in the Kafka topic of {row.queue}"
    else:
        where = f"in the {scheme} broker"
    return f"{where}, {due}"


# A job's attempts and audit rows are few; these caps keep a pathological
# one (replayed thousands of times) from turning a page into a huge read.
DETAIL_CAP = 500


@dataclass
class JobDetail:
    row: Any
    attempts: list[Any]
    audits: list[Any]


def load_job(engine: Engine, job_id: uuid.UUID, cap: int = DETAIL_CAP) -> JobDetail:
    """The job row, its attempts and its audit rows (primary key and the
    ``job_id`` indexes; at most ``cap`` of each, the latest)."""
    with db_errors("jobs show"), engine.connect() as conn:
        row = conn.execute(select(job).where(job.c.id == job_id)).first()
        if row is None:
            raise JobNotFoundError(job_id)
        attempts = conn.execute(
            select(attempt).where(attempt.c.job_id == job_id)
            .order_by(attempt.c.number.desc()).limit(cap)
        ).all()
        audits = conn.execute(
            select(audit).where(audit.c.job_id == job_id).order_by(audit.c.at.desc()).limit(cap)
        ).all()
    return JobDetail(row, sorted(attempts, key=lambda a: a.started_at),
                     sorted(audits, key=lambda a: a.at))


def timeline(row: Any) -> list[tuple[str, datetime]]:
    """The job's lifecycle instants that have happened, in lifecycle order."""
    events = [("created", row.created_at), ("due", row.due_at), ("claimed", row.claimed_at),
              ("enqueued", row.published_at), ("started", row.started_at),
              ("finished", row.finished_at)]
    return [(name, ts) for name, ts in events if ts is not None]


def show_job(engine: Engine, job_id: uuid.UUID, broker_scheme: str, now: datetime,
             with_payload: bool = False) -> str:
    detail = load_job(engine, job_id)
    row, attempts, audits = detail.row, detail.attempts, detail.audits
    lines = [
        f"job {row.id}",
        f"  task {shown(row.task)}  queue {shown(row.queue)}  state {row.state}  "
        f"version {row.version}  "
        f"attempt {row.attempt}/{row.max_attempts}",
    ]
    if row.key:
        lines.append(f"  key {shown(row.key)}")
    if row.tenant:
        lines.append(f"  tenant {shown(row.tenant)}  priority {row.priority}")
    lines.append(f"  now: {shown(where_now(row, broker_scheme, now))}")
    if with_payload:
        lines.append(f"  payload {json.dumps(row.payload, sort_keys=True)[:2000]}")
    lines.append("timeline")
    for name, ts in timeline(row):
        note = ""
        if name in ("claimed", "enqueued", "started", "finished"):
            late = (ts - row.due_at).total_seconds() * 1000
            note = f"  ({late:+.1f} ms vs due)"
        lines.append(f"  {name:<9} {_fmt(ts)}{note}")
    if attempts:
        lines.append("attempts")
        for a in attempts:
            err = f"  {a.error_class}: {shown(a.error or '')}" if a.error_class else ""
            lines.append(f"  #{a.number} {a.outcome or 'running'} on {shown(a.worker or '-')} "
                         f"started {_fmt(a.started_at)} finished {_fmt(a.finished_at)}{err}")
    if row.last_error:
        lines.append(f"last error ({row.error_class}): {shown(row.last_error)}")
    if audits:
        lines.append("audit")
        for a in audits:
            lines.append(f"  {_fmt(a.at)} {shown(a.action)} by {shown(a.operator)}: "
                         f"{shown(a.reason)}")
    return "\n".join(lines)
