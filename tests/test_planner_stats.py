"""The relay keeps the job table's planner statistics fresh on PostgreSQL
(core/planner_stats.py): a burst into a table the planner believes nearly
empty is analyzed within a pass, at most once per look, and never on
databases that keep their own statistics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from helpers import make_app

from duebox import planner_stats
from duebox.planner_stats import PlannerStats, stale
from duebox.relay import Relay


def test_stale_needs_many_rows_and_a_share_of_what_the_planner_believes() -> None:
    assert not stale(planner_stats.MIN_CHANGED, -1)  # never analyzed, few changes
    assert stale(planner_stats.MIN_CHANGED + 1, -1)
    assert stale(planner_stats.MIN_CHANGED + 1, 0)
    big = 1_000_000.0
    assert not stale(int(big * planner_stats.SHARE), big)  # autovacuum's business
    assert stale(int(big * planner_stats.SHARE) + 1, big)


def _believed(app_engine: sa.Engine) -> float:
    with app_engine.connect() as conn:
        return float(conn.execute(sa.text(
            "SELECT reltuples FROM pg_class WHERE oid = 'duebox_job'::regclass")).scalar_one())


def _burst(app: object, n: int) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    with app.engine.begin() as conn:  # type: ignore[attr-defined]
        app.schedule_many(conn, [app.new_job("effect", {"n": i}, at=later)  # type: ignore[attr-defined]
                                 for i in range(n)])
        # The inserting backend's counters reach the shared statistics now,
        # not up to a second later (PostgreSQL 15's pending-stats flush).
        conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))


ON_POSTGRES = pytest.mark.parametrize(
    "server_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)


@ON_POSTGRES
async def test_a_burst_is_analyzed_by_the_next_pass_and_only_once(
        server_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The second burst must land within CHECK_EVERY of the first look however
    # slow the machine (CI at load 30 took over the second 1 s to write it).
    monkeypatch.setattr(planner_stats, "CHECK_EVERY", 3600.0)
    app = make_app(server_url)
    with app.engine.begin() as conn:  # the planner's belief from before the burst
        conn.exec_driver_sql("ANALYZE duebox_job")
    before = _believed(app.engine)
    n = planner_stats.MIN_CHANGED * 3
    _burst(app, n)
    assert _believed(app.engine) == before  # nothing else refreshed it meanwhile

    relay = Relay(app)
    try:
        await relay.run_pass()
        assert relay.planner_stats.refreshed == 1
        assert _believed(app.engine) >= before + n * 0.9  # ANALYZE samples: about n more

        _burst(app, n)
        await relay.run_pass()  # within CHECK_EVERY of the last look: not even a look
        assert relay.planner_stats.refreshed == 1
    finally:
        for pipeline in relay.pipelines:
            await pipeline.broker.close()
        app.dispose()


@ON_POSTGRES
def test_few_changes_are_left_to_autovacuum(server_url: str) -> None:
    app = make_app(server_url)
    with app.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE duebox_job")
    _burst(app, 10)
    stats = PlannerStats(app.engine)
    assert stats.active
    assert stats.step() is False
    assert stats.refreshed == 0
    app.dispose()


def test_inactive_off_postgresql(database_url_all: str) -> None:
    app = make_app(database_url_all)
    stats = PlannerStats(app.engine)
    if app.engine.dialect.name == "postgresql":
        assert stats.active
    else:
        assert not stats.active
        assert not stats.due()
        assert stats.step() is False
    app.dispose()
