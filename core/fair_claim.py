"""The SQL behind the fair claim (relay/fairness.py decides the shares).

Every read here is one bounded seek on ``ix_duebox_job_class_due`` =
``(state, queue, tenant, priority, due_at)``:

* :func:`classes` walks the distinct ``(queue, tenant, priority)`` keys of
  ``SCHEDULED`` jobs with one ``ORDER BY ... LIMIT 1`` seek per key (a loose
  index scan), plus one seek for each key's earliest due time.  Its cost
  grows with the number of keys, never with the number of jobs.
* :func:`candidates` reads the ``limit`` earliest-due jobs of one key,
  ``FOR UPDATE SKIP LOCKED``: within a key the index is already in due order.

A NULL tenant (no tenant) is its own key; it is walked separately because
dialects disagree on where NULL sorts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, select

from .states import JobState
from .tables import job


@dataclass(frozen=True, slots=True)
class ClassKey:
    """A dispatch class: jobs of one queue and tenant at one priority."""

    queue: str
    tenant: str | None
    priority: int


@dataclass(frozen=True, slots=True)
class Candidate:
    id: uuid.UUID
    due_at: datetime
    priority: int


def _scheduled(*conds: ColumnElement[bool]) -> ColumnElement[bool]:
    return and_(job.c.state == JobState.SCHEDULED, *conds)


def _tenant_is(tenant: str | None) -> ColumnElement[bool]:
    return job.c.tenant.is_(None) if tenant is None else job.c.tenant == tenant


def _first(conn: Connection, column: Any, where: ColumnElement[bool]) -> Any:
    return conn.execute(select(column).where(where).order_by(column).limit(1)).first()


def _walk(conn: Connection, column: Any, where: ColumnElement[bool], cap: int) -> list[Any]:
    """Distinct non-NULL values of ``column`` under ``where``, one seek each."""
    out: list[Any] = []
    row = _first(conn, column, and_(where, column.is_not(None)))
    while row is not None and len(out) < cap:
        out.append(row[0])
        row = _first(conn, column, and_(where, column > row[0]))
    return out


def classes(conn: Connection, *, cap: int) -> list[tuple[ClassKey, datetime]]:
    """Every class with a SCHEDULED job (at most ``cap``) and its earliest due time."""
    found: list[tuple[ClassKey, datetime]] = []
    for queue in _walk(conn, job.c.queue, _scheduled(), cap):
        in_queue = _scheduled(job.c.queue == queue)
        tenants: list[str | None] = []
        if _first(conn, job.c.id, and_(in_queue, job.c.tenant.is_(None))) is not None:
            tenants.append(None)
        tenants += _walk(conn, job.c.tenant, in_queue, cap)
        for tenant in tenants:
            of_tenant = and_(in_queue, _tenant_is(tenant))
            for priority in _walk(conn, job.c.priority, of_tenant, cap):
                due = conn.execute(
                    select(job.c.due_at).where(of_tenant, job.c.priority == priority)
                    .order_by(job.c.due_at).limit(1)
                ).scalar()
                if due is not None:
                    found.append((ClassKey(queue, tenant, priority), due))
                if len(found) >= cap:
                    return found
    return found


def candidates(
    conn: Connection, key: ClassKey, *, horizon: datetime, after: datetime | None, limit: int,
    extra: ColumnElement[bool] | None = None,
) -> list[Candidate]:
    """The ``limit`` earliest-due jobs of ``key`` due by ``horizon`` (and after
    ``after``), locked for this transaction; rows other claims hold are skipped."""
    where = _scheduled(job.c.queue == key.queue, _tenant_is(key.tenant),
                       job.c.priority == key.priority, job.c.due_at <= horizon)
    if after is not None:
        where = and_(where, job.c.due_at > after)
    if extra is not None:
        where = and_(where, extra)
    stmt = (select(job.c.id, job.c.due_at, job.c.priority).where(where)
            .order_by(job.c.due_at).limit(limit).with_for_update(skip_locked=True))
    return [Candidate(*row) for row in conn.execute(stmt)]

