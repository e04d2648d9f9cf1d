"""Switching a queue's broker: jobs handed to a route that no longer serves
their queue go to the one that does now.

Every ``ENQUEUED`` mark records the route its broker is
(``published_to``: :func:`route_key`, the URL without its password).  When
a queue's route changes (``broker_routes``, or ``broker_url`` for the
default route), :func:`reroute` moves the queue's ``ENQUEUED`` jobs whose
``published_to`` is another route back to ``SCHEDULED`` with a new
``version``, fenced by their state: the relay then publishes them on the
new route at their due time, and the copies left on the old broker are
stale.  A worker that still consumes the old route receives each of them
at its due time and discards it (``stale_version``); a job a worker
started from the old route before the move is ``RUNNING`` and is not
moved.  Jobs still ``SCHEDULED`` (parked, or on ``sql://``) need nothing:
the new route's relay lane claims them.

:func:`leftovers` is what ``duebox routes`` shows: per queue, the jobs the
database still has on a route other than the queue's current one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import ColumnElement, Connection, and_, func, or_, select, update

from .credentials import redacted
from .leases.claims import update_locked
from .routes import Route, Routes
from .states import JobState
from .tables import job

_KEY_MOST = 255  # the published_to column


def route_key(url: str) -> str:
    """What ``published_to`` records for the broker at ``url``: the URL with
    its password hidden (no secret in the job table), or for a URL longer
    than the column its scheme and a digest."""
    key = redacted(url)
    if len(key) <= _KEY_MOST:
        return key
    scheme = urlsplit(url).scheme or "broker"
    return f"{scheme}://#{hashlib.sha256(key.encode()).hexdigest()}"


def fingerprint(routes: Routes) -> str:
    """A short digest of which route serves which queue, as
    :func:`route_key` names them: relays on different settings differ."""
    table = {"": route_key(routes.default),
             **{q: route_key(u) for q, u in sorted(routes.routed.items())}}
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]


def _stale(route: Route) -> ColumnElement[bool]:
    """``ENQUEUED`` jobs of ``route``'s queues handed to another route."""
    key = route_key(route.url)
    # Two ranges of ix_duebox_job_state_route rather than `<>`, which an
    # index cannot seek: with nothing left to move, the sweep reads nothing.
    where = and_(job.c.state == JobState.ENQUEUED,
                 or_(job.c.published_to < key, job.c.published_to > key))
    queues = route.where()
    return where if queues is None else and_(where, queues)


def reroute(conn: Connection, *, routes: Routes, now: datetime, limit: int) -> int:
    """Up to ``limit`` jobs per route moved off a route that no longer
    serves their queue: ``ENQUEUED`` → ``SCHEDULED``, ``version + 1``.
    Rows another transaction holds (a worker's start) are skipped and
    looked at again next time; the update re-checks the state, so a job a
    worker started meanwhile stays ``RUNNING``."""
    moved = 0
    for route in routes.all():
        stale = _stale(route)
        stmt = update(job).where(stale).values(
            state=JobState.SCHEDULED, version=job.c.version + 1, published_to=None,
            updated_at=now)
        # In no particular order: ordered by due time, the planner would
        # walk every ENQUEUED row in the due-time index to find none.
        candidates = (select(job.c.id).where(stale).limit(limit)
                      .with_for_update(skip_locked=True))
        moved += update_locked(conn, stmt, candidates)
    return moved


@dataclass(frozen=True, slots=True)
class Leftover:
    """Jobs of ``queue`` the database has on a route that no longer serves
    it: ``jobs`` of them, the earliest due at ``earliest``."""

    queue: str
    route_now: str
    published_to: str
    jobs: int
    earliest: datetime | None


def leftovers(conn: Connection, routes: Routes) -> list[Leftover]:
    """Per queue and old route, the ``ENQUEUED`` jobs a relay has not moved
    to the queue's current route yet (a relay does so when it starts, and
    every minute)."""
    rows = conn.execute(
        select(job.c.queue, job.c.published_to, func.count(), func.min(job.c.due_at))
        .where(job.c.state == JobState.ENQUEUED, job.c.published_to.is_not(None))
        .group_by(job.c.queue, job.c.published_to)
        .order_by(job.c.queue, job.c.published_to)).all()
    found = []
    for queue, published_to, n, earliest in rows:
        now_key = route_key(routes.url_for(queue))
        if published_to != now_key:
            # Shown as a URL with its password hidden: older releases
            # stored a password holding '/', '?' or '#' whole.
            found.append(Leftover(queue, now_key, redacted(published_to), int(n), earliest))
    return found


def enqueued_by_route(conn: Connection, queues: Sequence[str] | None = None
                      ) -> dict[tuple[str, str | None], int]:
    """``ENQUEUED`` jobs by (queue, ``published_to``); None: marked before
    routes were recorded (migration 0008)."""
    stmt: Any = (select(job.c.queue, job.c.published_to, func.count())
                 .where(job.c.state == JobState.ENQUEUED)
                 .group_by(job.c.queue, job.c.published_to))
    if queues:
        stmt = stmt.where(job.c.queue.in_(list(queues)))
    return {(q, p): int(n) for q, p, n in conn.execute(stmt)}


__all__ = ["Leftover", "enqueued_by_route", "fingerprint", "leftovers", "reroute",
           "route_key"]
