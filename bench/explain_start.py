"""EXPLAIN ANALYZE of every statement that starts a delivered job, on PostgreSQL.

    python bench/explain_start.py [--pg-url URL] [--jobs 50000] [--batch 100]

Creates its own database with ``--jobs`` jobs (most of them finished, some
scheduled ahead, some handed to the broker), then runs each start path as
the worker runs it, through its public function, with every statement it
sends explained first (``EXPLAIN (ANALYZE, BUFFERS)`` inside a savepoint,
rolled back, so the statement itself then runs on the same rows):

* the usual start (``jobstore.start_many``) of ``--batch`` messages, and
  the reason one of them did not start (``jobstore.why_not_started``);
* the batch lane's lock (``batch_sql.lock_startable``), its completion
  (``batch_sql.finish``) and a failed handler's start (``batch_sql.start_one``);
* your own consumer's completion (``own_queues.complete_steps``), a due
  message and an early one.

Then it drops the database.  Each statement's text is printed once with its
plan: compare the node types and the buffers before and after a change to
the start condition (core/leases/claims.py ``startable``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from run import DEFAULT_PG, pg_database
from sqlalchemy.orm import Session

import duebox
from duebox import migrate
from duebox.leases import batch_sql, jobstore, own_queues
from duebox.message import JobMessage, MessageRef
from duebox.producer import drive_sync
from duebox.tables import job

# Real time: your own consumer's completion reads the server's clock.
NOW = datetime.now(UTC)


class Explainer:
    """Explains each statement sent while :meth:`on` is active."""

    def __init__(self, engine: sa.Engine) -> None:
        self.label = ""
        sa.event.listen(engine, "before_cursor_execute", self._explain)

    @contextmanager
    def on(self, label: str) -> Iterator[None]:
        self.label = label
        try:
            yield
        finally:
            self.label = ""

    def _explain(self, conn: Any, cursor: Any, statement: str, parameters: Any,
                 context: Any, executemany: bool) -> None:
        if not self.label or executemany or not statement.lstrip().upper().startswith(
                ("SELECT", "UPDATE", "INSERT", "WITH")):
            return
        cursor.execute("SAVEPOINT explain_start")
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " + statement,
                       parameters)
        plan = [row[0] for row in cursor.fetchall()]
        cursor.execute("ROLLBACK TO SAVEPOINT explain_start")
        print(f"### {self.label}\n{' '.join(statement.split())}\n--")
        print("\n".join(folded(plan)), "\n")


def folded(plan: list[str]) -> list[str]:
    """The plan with its literals elided and a node repeated once per id of
    a list (``Bitmap Index Scan`` per ``OR``ed id) shown once, with a count."""
    lines = [_LITERAL.sub("…", line) for line in plan]
    out: list[str] = []
    i = 0
    while i < len(lines):
        for size in (3, 2, 1):
            block = lines[i:i + size]
            n = 1
            while lines[i + n * size:i + (n + 1) * size] == block:
                n += 1
            if n > 1:
                out += [block[0] + f"  (× {n})", *block[1:]]
                i += n * size
                break
        else:
            out.append(lines[i])
            i += 1
    return out


_LITERAL = re.compile(r"'[^']*'(::[a-z ]+)?(\[\])?")


def fill(app: duebox.Duebox, jobs: int) -> None:
    """``jobs`` jobs: 80 % SUCCEEDED, 10 % SCHEDULED an hour ahead, 10 %
    ENQUEUED and due (the ones the start paths take)."""
    with app.engine.begin() as conn:
        for start in range(0, jobs, 10_000):
            app.schedule_many(conn, [
                app.new_job("t", {"n": n}, at=NOW - timedelta(seconds=n % 3600))
                for n in range(start, min(jobs, start + 10_000))])
        ids = list(conn.execute(sa.select(job.c.id).order_by(job.c.id)).scalars())
        tenth = len(ids) // 10
        conn.execute(sa.update(job).where(job.c.id.in_(ids[:tenth])).values(
            state="SCHEDULED", due_at=NOW + timedelta(hours=1)))
        conn.execute(sa.update(job).where(job.c.id.in_(ids[tenth:2 * tenth])).values(
            state="ENQUEUED"))
        conn.execute(sa.update(job).where(job.c.id.in_(ids[2 * tenth:])).values(
            state="SUCCEEDED"))
        conn.execute(sa.text("ANALYZE duebox_job"))


def messages(app: duebox.Duebox, state: str, n: int) -> list[JobMessage]:
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.id, job.c.version, job.c.due_at)
                            .where(job.c.state == state).order_by(job.c.id).limit(n)).all()
    return [JobMessage(job_id=r.id, task="t", queue="default", version=r.version,
                       attempt=1, due_at=r.due_at, payload=None) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pg-url", default=DEFAULT_PG)
    p.add_argument("--jobs", type=int, default=50_000)
    p.add_argument("--batch", type=int, default=100)
    args = p.parse_args()
    with pg_database(args.pg_url) as url:
        app = duebox.Duebox(url, "sql://")
        app.add_task("t", lambda payload, ctx: None)
        try:
            migrate.upgrade(app.engine)
            fill(app, args.jobs)
            explain_paths(app, Explainer(app.engine), args.batch)
        finally:
            app.dispose()


def explain_paths(app: duebox.Duebox, explain: Explainer, batch: int) -> None:
    due = messages(app, "ENQUEUED", 2 * batch)
    ahead = messages(app, "SCHEDULED", 1)
    first, second = due[:batch], due[batch:]
    with app.engine.begin() as conn:
        with explain.on("usual start: jobstore.start_many"):
            jobstore.start_many(conn, messages=first + ahead, owner="w#1", now=NOW,
                                lease_until=NOW + timedelta(seconds=30), worker="w")
        with explain.on("why a message did not start: jobstore.why_not_started"):
            jobstore.why_not_started(conn, ahead[0], NOW)
        conn.rollback()
    with app.engine.begin() as conn:
        with explain.on("the lane's lock: batch_sql.lock_startable"):
            locked = batch_sql.lock_startable(conn, second, NOW, "w#2")
        recs = [locked[m.job_id] for m in second if m.job_id in locked]
        with explain.on("the lane's completion: batch_sql.finish"):
            batch_sql.finish(conn, [(r, NOW, "succeeded") for r in recs[1:]], NOW, "w")
        with explain.on("a failed handler's start: batch_sql.start_one"):
            batch_sql.start_one(conn, recs[0], NOW, NOW, 30, "w")
        conn.rollback()
    for label, msg in (("own consumer's completion, due", first[0]),
                       ("own consumer's completion, early", ahead[0])):
        with Session(app.engine) as session, session.begin():
            ref = MessageRef(msg.job_id, msg.version, msg.task)
            with explain.on(f"{label}: own_queues.complete_steps"):
                drive_sync(session, own_queues.complete_steps(ref, "postgresql", NOW))
            session.rollback()


if __name__ == "__main__":
    main()
