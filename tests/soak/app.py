"""The soak's duebox app, its tasks and its two bookkeeping tables.

* ``soak_plan``: what the load driver asked for, one row per job, written in
  the same transaction as the ``schedule`` / ``cancel`` / ``reschedule`` call
  it records, so the plan and duebox's job table can never disagree.
* ``soak_effect``: one row per committed handler run, written through
  ``ctx.session`` (the handler's own transaction, which also holds the SQL
  dedupe row and the fenced completion).  Its key is a sequence, *not* the
  job id, so a double effect is a second row the verdict can count instead of
  a primary-key error that would hide it.  ``started_us`` is the database
  server's clock (``clock_timestamp()``), the one clock no faketime'd process
  can skew, so an early start is measured against the truth.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

import duebox
from duebox import RetryPolicy, Transient

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
soak_metadata = sa.MetaData()

plan = sa.Table(
    "soak_plan",
    soak_metadata,
    sa.Column("job_id", sa.Uuid(), primary_key=True),
    sa.Column("kind", sa.String(20), nullable=False),  # plain | flaky
    sa.Column("due_us", sa.BigInteger, nullable=False),  # latest due time asked for
    sa.Column("cancelled", sa.Boolean, nullable=False, default=False),
    sa.Column("rescheduled", sa.Integer, nullable=False, default=0),
)

effect = sa.Table(
    "soak_effect",
    soak_metadata,
    sa.Column("seq", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job_id", sa.Uuid(), nullable=False, index=True),
    sa.Column("task", sa.String(40), nullable=False),
    sa.Column("due_us", sa.BigInteger, nullable=False),  # the record's due time (retries move it)
    sa.Column("started_us", sa.BigInteger, nullable=False),
    sa.Column("worker", sa.String(200), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("lease_generation", sa.BigInteger, nullable=False),
)

# Short leases so a SIGSTOP of a few seconds outlives them and a killed
# process's work is recovered quickly; a retry backoff of at most 1 s.
LEASE_SECONDS = 2.0
# redeliver_after: well above the queue waits faults cause.  Below the backlog
# every waiting job is published again once per redeliver_after and the
# duplicates deepen the backlog (at 3 s: p50 lateness 22 s on amqp://).  No
# fault here needs it: Redis's flush is reconciled through its sentinel key,
# dead workers' messages come back by claim_idle (Redis) or the broker (AMQP).
SETTINGS = duebox.Settings(
    lease_seconds=LEASE_SECONDS, poll_interval=0.1, clock_skew_margin=0.3,
    batch_size=100, concurrency=8, redeliver_after=60.0,
)
RETRY = RetryPolicy(base=0.2, cap=1.0)
# Generous: a job whose worker is killed mid-run also spends an attempt, and
# running out of attempts would turn a fault into a DEAD job (counted as lost).
MAX_ATTEMPTS = 12
SCHEDULE_NAME = "soak-every-2s"
SCHEDULE_CRON = "*/2 * * * * *"


class FlakyError(Transient):
    """Raised on purpose by ``soak_flaky`` until its ``fail`` attempts are used up."""


def build_app(database_url: str | None, broker_url: str,
              engine: sa.Engine | None = None) -> duebox.Duebox:
    app = duebox.Duebox(database_url, broker_url, engine=engine,
                        settings=SETTINGS)

    @app.task("soak_plain", max_attempts=MAX_ATTEMPTS, retry=RETRY)
    def soak_plain(payload: Any, ctx: duebox.JobContext) -> None:
        write_effect(ctx)
        time.sleep(0.002)  # a little work, so a kill can land inside the transaction

    @app.task("soak_flaky", max_attempts=MAX_ATTEMPTS, retry=RETRY)
    def soak_flaky(payload: Any, ctx: duebox.JobContext) -> None:
        # The effect is written first and must vanish with the rollback.
        write_effect(ctx)
        if ctx.attempt <= int(payload["fail"]):
            raise FlakyError(f"attempt {ctx.attempt} fails on purpose")

    @app.task("soak_recurring", max_attempts=MAX_ATTEMPTS, retry=RETRY)
    def soak_recurring(payload: Any, ctx: duebox.JobContext) -> None:
        write_effect(ctx)

    return app


def write_effect(ctx: duebox.JobContext) -> None:
    due_us = (ctx.due_at - EPOCH) // timedelta(microseconds=1)
    started = sa.cast(sa.func.extract("epoch", sa.func.clock_timestamp()) * 1_000_000,
                      sa.BigInteger)
    ctx.session.execute(effect.insert().values(
        job_id=ctx.job_id, task=ctx.task, due_us=due_us, started_us=started,
        worker=ctx.worker, attempt=ctx.attempt, version=ctx.version,
        lease_generation=ctx.lease_generation,
    ))
