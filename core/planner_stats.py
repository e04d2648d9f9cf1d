"""Fresh planner statistics for the job table on PostgreSQL, kept by the relay.

PostgreSQL plans every claim, lock and completion from the job table's
statistics.  Autovacuum refreshes them only after ``50 + 10 %`` of the rows
it last counted have changed, and looks at most once a minute
(``autovacuum_naptime``); psycopg prepares a statement after five runs and
PostgreSQL may then keep one generic plan for it.  A table that grew from
nearly empty to a backlog in seconds — a new deployment's first burst, the
9 am burst after a quiet night, every benchmark — is planned as if it held
a dozen rows: the completion joined its batch to a scan of every active
row instead of looking the ids up by key, and the lane's claim read and
sorted every due row of its queue for each batch of 32.  On a 2-core
machine, 20,000 due jobs through ``duebox relay`` and ``duebox worker`` cost
PostgreSQL 0.50 ms of CPU each that way, 0.28 ms with this refresh, and
0.11 ms with statistics fresh before the first claim (CHANGELOG, #20).

So the relay, at most every :data:`CHECK_EVERY` seconds, reads how many
rows changed since the last ``ANALYZE`` (``pg_stat_user_tables``, a
counter read, no scan) and runs ``ANALYZE (SKIP_LOCKED)`` on the job table
when that is more than :data:`MIN_CHANGED` rows and :data:`SHARE` of the
rows the planner believes it has.  ``ANALYZE`` samples at most 30,000 rows
(tens of milliseconds) and invalidates the cached plans, prepared ones
included; ``SKIP_LOCKED`` leaves it to another relay or autovacuum already
at it.  A role that may not analyze the table (PostgreSQL skips it with a
warning) only loses the refresh.  Other databases refresh their own
statistics as rows change (InnoDB's persistent statistics at 10 %) or have
no such planner (SQLite): nothing to do there.
"""

from __future__ import annotations

import logging
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from .tables import job

log = logging.getLogger("duebox.relay")

CHECK_EVERY = 1.0  # seconds between two looks at the counter
MIN_CHANGED = 1000  # rows changed since the last ANALYZE, at least ...
SHARE = 0.2  # ... and this share of the rows the planner believes the table has

_CHANGED = sa.text(
    "SELECT s.n_mod_since_analyze, c.reltuples FROM pg_stat_user_tables s "
    "JOIN pg_class c ON c.oid = s.relid WHERE s.relid = to_regclass(:table)")


def stale(changed: int, believed: float) -> bool:
    """Whether the statistics are stale: ``changed`` rows since the last
    ANALYZE against the ``believed`` row count (``reltuples``: -1 never
    analyzed)."""
    return changed > max(MIN_CHANGED, SHARE * max(believed, 0.0))


class PlannerStats:
    """The relay's step (see the module notes); inactive off PostgreSQL."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.active = engine.dialect.name == "postgresql"
        self._next = 0.0
        self.refreshed = 0  # ANALYZE runs so far (tests, docs)

    def due(self) -> bool:
        return self.active and time.monotonic() >= self._next

    def step(self) -> bool:
        """Look at the counter if it is time; ANALYZE if stale.  True when
        it ran ANALYZE."""
        if not self.due():
            return False
        self._next = time.monotonic() + CHECK_EVERY
        try:
            with self.engine.connect() as conn:
                row = conn.execute(_CHANGED, {"table": job.fullname}).first()
                if row is None or not stale(int(row[0] or 0), float(row[1])):
                    return False
                conn.exec_driver_sql(f"ANALYZE (SKIP_LOCKED) {job.fullname}")
                conn.commit()
        except SQLAlchemyError as exc:  # the database is away: the next look tries again
            log.debug("planner statistics not refreshed: %s", exc)
            return False
        self.refreshed += 1
        return True


__all__ = ["CHECK_EVERY", "MIN_CHANGED", "SHARE", "PlannerStats", "stale"]
