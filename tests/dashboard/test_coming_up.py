"""The overview's "Coming up" counts schedule fire times (issue #22 item 7):
those not generated yet, in the slice their (jittered) due time falls in,
and never a fire time already counted as a job."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from conftest import reset_tables
from sqlalchemy.orm import Session

import duebox
from duebox import FakeClock
from duebox.reads.pages import due_ahead, fires_ahead
from duebox.schedules import occurrences

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def test_fire_times_count_once_each(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/coming.db"
    reset_tables(url)
    app = duebox.Duebox(url, "sql://", clock=FakeClock(T0))
    app.task("tick")(lambda p, c: None)
    try:
        with Session(app.engine) as s, s.begin():
            app.schedules.add(s, "quarter", "tick", "*/15 * * * *")  # 4 an hour
            app.schedules.add(s, "daily", "tick", "0 3 * * *")  # +3 h
            app.schedules.add(s, "paused", "tick", "* * * * *", paused=True)
            app.schedules.add(s, "late", "tick", "0 9 * * *")  # beyond the window
        # The relay generated the first quarter-hour's occurrence (+15 min):
        # now a job, no longer a fire time ahead.
        app.clock.advance(14 * 60 + 58)  # type: ignore[attr-defined]
        with app.engine.begin() as conn:
            made = occurrences.generate_due(conn, now=app.clock.now(), limit=10,
                                            lookahead=2.0, grace=60.0)
        assert made.occurrences == 1
        now = T0
        with app.engine.connect() as conn:
            fires = fires_ahead(conn, now, horizon=6 * 3600, buckets=6)
            jobs = due_ahead(conn, now, horizon=6 * 3600, buckets=6)
        # Hourly slices: the first hour fires at :15, :30 and :45; :15 is a
        # job now, so 2 fire times are left; the 03:00 daily fire lands in
        # slice 3.
        assert fires == [2, 4, 4, 5, 4, 4]
        assert [b.count for b in jobs] == [1, 0, 0, 0, 0, 0]
        with app.engine.connect() as conn:
            capped = fires_ahead(conn, now, horizon=6 * 3600, buckets=6, cap=5)
        assert sum(capped) == 5
    finally:
        app.dispose()


def test_jitter_moves_a_fire_into_its_due_slice(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/jitter.db"
    reset_tables(url)
    app = duebox.Duebox(url, "sql://", clock=FakeClock(T0))
    app.task("tick")(lambda p, c: None)
    kw: dict[str, Any] = {"jitter": 3600}
    try:
        with Session(app.engine) as s, s.begin():
            sid = app.schedules.add(s, "j", "tick", "59 0 * * *", **kw)
        fire = T0 + timedelta(minutes=59)
        assert isinstance(sid, uuid.UUID)
        shift = occurrences.jitter_for(sid, fire, 3600)
        slot = int((fire + shift - T0).total_seconds() // 3600)
        with app.engine.connect() as conn:
            fires = fires_ahead(conn, T0, horizon=2 * 3600, buckets=2)
        assert fires == [1 if i == slot else 0 for i in range(2)]
    finally:
        app.dispose()
