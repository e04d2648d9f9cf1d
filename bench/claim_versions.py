"""PostgreSQL's CPU per job for the relay's claim and mark: two row versions
per job (today: the claim writes DISPATCHING, the mark writes ENQUEUED and
rides with the next claim's statement) against one (a claim that writes
ENQUEUED at once, plus a row per batch in flight in duebox_lease, inserted
by the claim and deleted by the next one): the cost side of issue #20's
"mark in the claim" lever (docs/design.md, "Why the claim does not write
ENQUEUED").

    python bench/claim_versions.py [N] [ROUNDS]     # default 50,000 jobs, 2 rounds

Bare psycopg, the relay's statements by hand, batches of 500, jobs already
due, a fresh and reloaded table per run; the two alternate.  The server
backend's CPU comes from /proc (this script must run on the database's
machine); wall time is printed too but moves with the machine's load.
Prints one line per run.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import UTC, datetime, timedelta

import psycopg
import trials
from run import DEFAULT_PG, pg_database
from sqlalchemy.engine import make_url

CLAIMABLE = ("SELECT id FROM duebox_job WHERE state = 'SCHEDULED' AND due_at <= %(horizon)s "
             "ORDER BY due_at LIMIT 500 FOR UPDATE SKIP LOCKED")
TWO_VERSIONS = (
    "WITH marked AS (UPDATE duebox_job SET state = 'ENQUEUED', published_at = %(now)s, "
    "published_to = 'x', lease_owner = NULL, lease_until = NULL, updated_at = %(now)s "
    "WHERE id IN (SELECT id FROM duebox_job WHERE id = ANY(%(ids)s) AND state = 'DISPATCHING' "
    "AND lease_owner = %(prev)s ORDER BY id FOR UPDATE) RETURNING id), "
    "claimed AS (UPDATE duebox_job SET state = 'DISPATCHING', lease_owner = %(owner)s, "
    "lease_generation = lease_generation + 1, lease_until = %(until)s, claimed_at = %(now)s, "
    f"updated_at = %(now)s WHERE id IN ({CLAIMABLE}) RETURNING {trials.ROW_COLUMNS}) "
    "SELECT (SELECT count(*) FROM marked), claimed.* FROM (SELECT 1) one "
    "LEFT JOIN claimed ON true")
ONE_VERSION = (
    "WITH done AS (DELETE FROM duebox_lease WHERE name = %(prevname)s RETURNING 1), "
    "claimed AS (UPDATE duebox_job SET state = 'ENQUEUED', lease_owner = %(owner)s, "
    "lease_generation = lease_generation + 1, lease_until = %(until)s, claimed_at = %(now)s, "
    "published_at = %(now)s, published_to = 'x', updated_at = %(now)s "
    f"WHERE id IN ({CLAIMABLE}) RETURNING {trials.ROW_COLUMNS}), "
    "inflight AS (INSERT INTO duebox_lease (name, owner, epoch, expires_at) "
    "SELECT %(name)s, %(owner)s, 0, %(until)s WHERE EXISTS (SELECT 1 FROM claimed)) "
    "SELECT (SELECT count(*) FROM done), claimed.* FROM (SELECT 1) one "
    "LEFT JOIN claimed ON true")


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(dsn: str, stmt: str) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        pid = row[0]
        cpu, t0 = _cpu(pid), time.perf_counter()
        prev, ids, n = "", [], 0
        for seq in range(10**9):
            owner, now = f"r#{seq}", datetime.now(UTC)
            rows = conn.execute(stmt, {
                "now": now, "ids": ids, "prev": prev, "owner": owner, "horizon": now,
                "until": now + timedelta(seconds=30), "prevname": f"claim:{prev}",
                "name": f"claim:{owner}"}).fetchall()
            got = [r for r in rows if r[1] is not None]
            n, ids, prev = n + len(got), [r[1] for r in got], owner
            if len(got) < 500:
                break
        wall, cpu = time.perf_counter() - t0, _cpu(pid) - cpu
    return {"jobs": n, "pg_cpu_us_per_job": cpu / n * 1e6, "jobs_per_s": n / wall}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with pg_database(os.environ.get("DUEBOX_BENCH_PG", DEFAULT_PG)) as url:
        dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        pair = [("two row versions", TWO_VERSIONS), ("one row version", ONE_VERSION)]
        for i in range(rounds):
            for name, stmt in pair if i % 2 == 0 else pair[::-1]:
                trials.fresh_schema(url)
                app = trials.make_app(url)
                trials.load_due(app, n, trials.due_now())
                app.dispose()
                print(name, {k: round(v, 1) for k, v in run(dsn, stmt).items()}, flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
