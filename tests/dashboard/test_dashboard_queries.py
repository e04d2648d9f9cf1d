"""The dashboard's query layer on SQLite and PostgreSQL: job search pages,
the charts' series, leases and schedules — all bounded."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import reset_tables
from helpers import make_app, schedule_committed
from sqlalchemy import update

from duebox import ValidationError
from duebox.reads.pages import (
    Cursor,
    JobFilter,
    due_ahead,
    in_flight_by_owner,
    lateness_buckets,
    named_leases,
    parse_filter,
    schedules_page,
    search_jobs,
)
from duebox.states import JobState
from duebox.tables import job

from .seed import Seeded


def _all_pages(conn: object, f: JobFilter, limit: int) -> list[uuid.UUID]:
    seen: list[uuid.UUID] = []
    after = None
    for _ in range(100):
        page = search_jobs(conn, f, limit=limit, after=after)  # type: ignore[arg-type]
        seen += [r.id for r in page.rows]
        if page.next is None:
            return seen
        after = Cursor.decode(page.next.encode())  # round-trips through the URL form
    raise AssertionError("paging did not end")


def test_search_pages_through_every_state_once_newest_due_first(seeded: Seeded) -> None:
    app = seeded.app
    everything = {*seeded.ok, *seeded.dead, *seeded.future}
    with app.engine.connect() as conn:
        ids = _all_pages(conn, JobFilter(), limit=7)
        assert len(ids) == len(set(ids)), "a job appeared on two pages"
        assert everything <= set(ids)
        dues = [search_jobs(conn, JobFilter(text=str(i))).rows[0].due_at for i in ids[:10]]
        assert dues == sorted(dues, reverse=True)
        dead = _all_pages(conn, JobFilter(state=JobState.DEAD), limit=1)
        assert set(dead) == set(seeded.dead)
        queue = _all_pages(conn, JobFilter(queue="payments"), limit=50)
        assert set(queue) == set(seeded.dead)


def test_search_by_key_id_and_due_range(seeded: Seeded) -> None:
    app = seeded.app
    with app.engine.connect() as conn:
        by_key = search_jobs(conn, JobFilter(text="order-1")).rows
        assert [r.id for r in by_key] == [seeded.dead[1]]
        by_id = search_jobs(conn, JobFilter(text=str(seeded.ok[3]))).rows
        assert [r.id for r in by_id] == [seeded.ok[3]]
        assert search_jobs(conn, JobFilter(text="no-such-key")).rows == []
        now = app.clock.now()
        window = JobFilter(state=JobState.SCHEDULED, due_from=now + timedelta(minutes=10),
                           due_to=now + timedelta(minutes=20))
        rows = search_jobs(conn, window).rows
        assert {r.key for r in rows} == {"upcoming-1", "upcoming-2"}


def test_bad_search_fields_are_named() -> None:
    with pytest.raises(ValidationError, match="state"):
        parse_filter({"state": "sleeping"})
    with pytest.raises(ValidationError, match="from"):
        parse_filter({"from": "yesterday"})
    with pytest.raises(ValidationError, match="after"):
        Cursor.decode("not-a-cursor")
    f = parse_filter({"state": "dead", "from": "2026-03-29T02:30", "queue": " q "})
    assert f.state == JobState.DEAD
    assert f.queue == "q"
    assert f.due_from is not None
    assert f.due_from.utcoffset() == timedelta(0)


def test_charts_count_what_is_coming_and_measure_lateness(seeded: Seeded) -> None:
    app = seeded.app
    now = app.clock.now()
    with app.engine.connect() as conn:
        ahead = due_ahead(conn, now, horizon=6 * 3600, buckets=24)
        late = lateness_buckets(conn, now)
    # 30 jobs every 7 minutes from +5 min: 15-minute slices hold 2 or 3.
    assert sum(b.count for b in ahead) == len(seeded.future) + 1  # + the leaky one
    assert ahead[0].count == 2
    assert not any(b.capped for b in ahead)
    started = sum(b.count for b in late)
    assert started == len(seeded.ok) + len(seeded.dead)
    last = [b for b in late if b.count][-1]
    assert last.p50 is not None
    assert last.p99 is not None
    assert 0 <= last.p50 <= last.p99 < 30


def test_due_ahead_counts_are_capped(tmp_path: Path) -> None:
    # SQLite only: resetting the PostgreSQL database would wipe ``seeded``'s.
    url = f"sqlite:///{tmp_path}/cap.db"
    reset_tables(url)
    app = make_app(url)
    for _ in range(5):
        schedule_committed(app, "noop", delay=60)
    with app.engine.connect() as conn:
        (bucket,) = due_ahead(conn, app.clock.now(), horizon=3600, buckets=1, cap=3)
    assert (bucket.count, bucket.capped) == (3, True)
    app.dispose()


def test_leases_processes_and_schedules(seeded: Seeded) -> None:
    app = seeded.app
    with app.engine.connect() as conn:
        leases = named_leases(conn)
        flying = in_flight_by_owner(conn)
        page, nxt = schedules_page(conn, limit=1)
    assert [r.name for r in leases] == ["shard:0-511"], "process rows are not named leases"
    assert flying == {}
    assert [i.name for i in page] == ["nightly-report"]
    assert nxt is None


def test_leased_jobs_are_counted_per_process(seeded: Seeded) -> None:
    """A worker leases each job as "<worker>#<job id>"; a relay as itself."""
    app = seeded.app
    relay_ids, worker_ids = seeded.future[:3], seeded.future[3:5]
    with app.engine.begin() as conn:
        conn.execute(update(job).where(job.c.id.in_(relay_ids))
                     .values(state=JobState.DISPATCHING, lease_owner="relay:r1"))
        for i in worker_ids:
            conn.execute(update(job).where(job.c.id == i)
                         .values(state=JobState.RUNNING, lease_owner=f"worker:w1#{i}"))
    try:
        with app.engine.connect() as conn:
            assert in_flight_by_owner(conn) == {"relay:r1": {"DISPATCHING": 3},
                                                "worker:w1": {"RUNNING": 2}}
            assert in_flight_by_owner(conn, cap=4) in (
                {"relay:r1": {"DISPATCHING": 3}, "worker:w1": {"RUNNING": 1}},
                {"relay:r1": {"DISPATCHING": 2}, "worker:w1": {"RUNNING": 2}},
            ), "the cap bounds the rows read"
    finally:  # the module's other tests share these rows
        with app.engine.begin() as conn:
            conn.execute(update(job).where(job.c.id.in_([*relay_ids, *worker_ids]))
                         .values(state=JobState.SCHEDULED, lease_owner=None))
