"""EXPLAIN ANALYZE of the fair claim's reads on PostgreSQL (docs/scale.md).

    python bench/explain_claim.py [--pg-url URL]

Creates its own database with 200,000 SCHEDULED jobs in 150 (queue, tenant,
priority) classes, prints the plans of the per-class candidate read, two
class-walk seeks and a sharded claim (one shard of four held, as by one
relay of four), and drops the database.
"""

from __future__ import annotations

import argparse
import os
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

import duebox
from duebox import migrate
from duebox.relay.shards import ShardConfig, ShardOwner
from duebox.tables import job

PG = os.environ.get("DUEBOX_BENCH_PG", "postgresql+psycopg://127.0.0.1:5432/postgres")
T = datetime(2030, 1, 1, tzinfo=UTC)


def explain(engine: sa.Engine, stmt: Any) -> None:
    with engine.connect() as conn:
        sql = str(stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
        print(sql, "\n--")
        for row in conn.execute(sa.text("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + sql)):
            print(row[0])
        print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pg-url", default=PG)
    args = p.parse_args()
    admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT")
    name = f"duebox_explain_{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    app = duebox.Duebox(args.pg_url.rsplit("/", 1)[0] + "/" + name, "sql://")
    app.add_task("t", lambda payload, ctx: None)
    try:
        migrate.upgrade(app.engine)
        with app.engine.begin() as conn:
            for _ in range(20):
                app.schedule_many(conn, [
                    app.new_job("t", None, at=T + timedelta(seconds=j % 600),
                                tenant=f"t{j % 50}", priority=j % 3) for j in range(10_000)])
            conn.execute(sa.text("ANALYZE duebox_job"))
        scheduled = job.c.state == "SCHEDULED"
        explain(app.engine, sa.select(job.c.id, job.c.due_at, job.c.priority).where(
            scheduled, job.c.queue == "default", job.c.tenant == "t7", job.c.priority == 1,
            job.c.due_at <= T + timedelta(seconds=300),
        ).order_by(job.c.due_at).limit(500).with_for_update(skip_locked=True))
        explain(app.engine, sa.select(job.c.tenant).where(
            scheduled, job.c.queue == "default", job.c.tenant > "t7",
        ).order_by(job.c.tenant).limit(1))
        explain(app.engine, sa.select(job.c.priority).where(
            scheduled, job.c.queue == "default", job.c.tenant == "t7", job.c.priority > 0,
        ).order_by(job.c.priority).limit(1))
        owner = ShardOwner(ShardConfig(4), "relay:explain", 0.5)
        now = datetime.now(UTC)
        owner.step(app.engine, now)
        # As one relay of four holds it: shard 0 only, so the plan shows the
        # rows of the other shards the claim reads and filters out.
        owner.owned = {k: o for k, o in owner.owned.items() if k == 0}
        explain(app.engine, sa.select(job.c.id).where(
            scheduled, job.c.due_at <= T + timedelta(seconds=300), owner.fence(now),
        ).order_by(job.c.due_at).limit(500).with_for_update(skip_locked=True))
    finally:
        app.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
