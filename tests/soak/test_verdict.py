"""The soak's accounting must be able to fail: each kind of bad outcome,
planted in a real database, is counted by :func:`judge` and fails the verdict;
a clean run passes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import reset_tables
from sqlalchemy.orm import Session

from duebox.tables import job
from tests.soak.app import EPOCH, build_app, effect, plan, soak_metadata
from tests.soak.fleet import Fleet
from tests.soak.verdict import judge

DUE = datetime.now(UTC) + timedelta(seconds=5)
DUE_US = (DUE - EPOCH) // timedelta(microseconds=1)


pytestmark = pytest.mark.postgres  # the soak runs on PostgreSQL only


@pytest.fixture
def engine(pg_server_url: str) -> Iterator[sa.Engine]:
    reset_tables(pg_server_url)
    engine = sa.create_engine(pg_server_url)
    try:
        yield engine
    finally:
        engine.dispose()


def plant(engine: sa.Engine, outcomes: list[str]) -> list[uuid.UUID]:
    """One job per outcome, with the job row, plan row and effects it implies."""
    app = build_app(None, "sql://", engine=engine)
    soak_metadata.drop_all(engine)
    soak_metadata.create_all(engine)
    with Session(engine) as s, s.begin():
        ids = app.schedule_many(s, [app.new_job("soak_plain", at=DUE) for _ in outcomes])
        assert isinstance(ids, list)
        for jid, outcome in zip(ids, outcomes, strict=True):
            cancelled = outcome in ("cancelled", "cancelled_ran")
            s.execute(plan.insert().values(job_id=jid, kind="plain", due_us=DUE_US,
                                           cancelled=cancelled, rescheduled=0))
            state = {"cancelled": "CANCELLED", "cancelled_ran": "CANCELLED", "dead": "DEAD",
                     "pending": "ENQUEUED"}.get(outcome, "SUCCEEDED")
            s.execute(sa.update(job).where(job.c.id == jid)
                      .values(state=state, lease_generation=2))
            runs = {"ok": 1, "double": 2, "early": 1, "cancelled_ran": 1, "stale": 1}
            for _ in range(runs.get(outcome, 0)):
                s.execute(effect.insert().values(
                    job_id=jid, task="soak_plain", due_us=DUE_US,
                    started_us=DUE_US - 1 if outcome == "early" else DUE_US + 1000,
                    worker="w", attempt=1, version=1,
                    lease_generation=1 if outcome == "stale" else 2))
    return ids


def test_a_clean_run_passes(engine: sa.Engine, tmp_path: Path) -> None:
    plant(engine, ["ok", "ok", "cancelled"])
    v = judge(engine, [], Fleet("", "sql://", tmp_path))
    assert v.ok, v.failures
    assert v.figures["jobs that should have run"] == 2
    assert v.figures["effects"] == 2


def test_every_kind_of_bad_outcome_is_counted(engine: sa.Engine, tmp_path: Path) -> None:
    outcomes = ["ok", "dead", "pending", "double", "early", "cancelled_ran", "stale"]
    ids = plant(engine, outcomes)
    v = judge(engine, [], Fleet("", "sql://", tmp_path))
    by = dict(zip(outcomes, map(str, ids), strict=True))
    assert not v.ok
    assert v.failures == {
        "lost": [by["dead"]],
        "unfinished at the drain deadline": [by["pending"]],
        "double effects": [by["double"]],
        "early starts": [by["early"]],
        "cancelled but ran": [by["cancelled_ran"]],
        "stale-generation writes accepted": [by["stale"]],
    }
