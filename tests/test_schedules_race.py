"""Ten relay processes racing over the same 100 schedules.

Time is shared and injected: every process reads the same fake clock (a
``multiprocessing.Value`` the test advances a minute every few milliseconds),
so two hours across New York's fall-back night pass in seconds.  At the
end every schedule must hold exactly the occurrences its rule defines between
its first fire time and its cursor — none missing, none twice — and every
cursor must sit just past the final time (no schedule silently stopped).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue as queue_mod
import random
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import duebox
from duebox import FakeClock, Settings
from duebox.schedules import occurrences
from duebox.schedules.api import ScheduleInfo
from duebox.tables import job, schedule

PROCESSES = 10
SCHEDULES = 100
START = datetime(2030, 11, 3, 5, 15, tzinfo=UTC)  # New York falls back at 06:00Z
TICKS = 120  # one fake minute each: through both passes of the repeated hour
SETTINGS: dict[str, Any] = {"poll_interval": 1.0, "batch_size": 25,
                            # nothing counts as missed: every policy fires every time
                            "misfire_grace": 86_400.0}
RULES = [
    ("30 */2 * * * *", "UTC", "first"),
    ("* * * * *", "America/New_York", "both"),
    ("*/5 * * * *", "Europe/Berlin", "first"),
    ("0 * * * *", "America/New_York", "last"),
    ("*/10 * * * *", "Australia/Lord_Howe", "first"),
    ("*/15 * * * *", "America/New_York", "first"),
    ("7,37 * * * *", "America/New_York", "both"),
]


class SharedClock:
    def __init__(self, value: Any) -> None:
        self.value = value

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.value.value, UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)


def relay_process(url: str, clock_value: Any, stop: Any, ready: Any, results: Any,
                  index: int) -> None:
    from duebox.relay import Relay

    app = duebox.Duebox(url, "sql://", clock=SharedClock(clock_value),
                        settings=Settings(**SETTINGS))
    app.add_task("tick", lambda payload, ctx: None)
    relay = Relay(app, name=f"relay-{index}", recover_interval=3600)
    rng = random.Random(index)

    async def main() -> tuple[int, int, int]:
        passes = created = 0
        ready.put(index)
        while not stop.is_set():
            stats = await relay.run_pass()
            passes += 1
            created += stats.occurrences
            await asyncio.sleep(rng.uniform(0, 0.004))
        return passes, created, relay.schedules.errors

    try:
        results.put((index, *asyncio.run(main())))
    finally:
        app.dispose()


@pytest.mark.slow
def test_ten_relays_racing_over_a_hundred_schedules(database_url: str) -> None:
    app = duebox.Duebox(database_url, "sql://", clock=FakeClock(START),
                        settings=Settings(**SETTINGS))
    app.add_task("tick", lambda payload, ctx: None)
    with Session(app.engine) as s, s.begin():
        for i in range(SCHEDULES):
            cron, zone, fold = RULES[i % len(RULES)]
            app.schedules.add(s, f"s{i:03d}", "tick", cron, timezone=zone, fold=fold,
                              misfire=("fire_all", "fire_once", "skip")[i % 3])
    with Session(app.engine) as s:
        created = {i.id: i for i in app.schedules.list(s)}  # type: ignore[union-attr]

    # A fork server: fresh processes (no inherited connections), forked from
    # one that imported duebox once.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["duebox", "duebox.relay", "sqlalchemy", __name__])
    clock_value = ctx.Value("d", START.timestamp())
    stop, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=relay_process, daemon=True,
                         args=(database_url, clock_value, stop, ready, results, n))
             for n in range(PROCESSES)]
    for p in procs:
        p.start()
    try:
        for _ in range(PROCESSES):
            ready.get(timeout=60)
        for _ in range(TICKS):
            with clock_value.get_lock():
                clock_value.value += 60
            time.sleep(0.02)
        end = START + timedelta(minutes=TICKS)
        lookahead = SETTINGS["poll_interval"] + 1.0
        deadline = time.monotonic() + 60
        while True:  # let them catch up with the final time
            with app.engine.connect() as conn:
                low = conn.execute(sa.select(sa.func.min(schedule.c.next_fire_at))).scalar()
            if low is not None and low > end + timedelta(seconds=lookahead):
                break
            assert time.monotonic() < deadline, f"schedules stuck at {low}"
            time.sleep(0.1)
    finally:
        stop.set()
        outcome = []
        for p in procs:
            p.join(timeout=30)
        while True:
            try:
                outcome.append(results.get(timeout=1))
            except queue_mod.Empty:
                break
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    assert len(outcome) == PROCESSES
    assert all(errors == 0 and passes > 0 for _, passes, _, errors in outcome)
    # The work really was shared among the processes, where the database
    # locks rows.  SQLite has one writer at a time and its busy handler backs
    # the waiting ones off (up to 100 ms a sleep) while the writer that just
    # committed takes the lock again: one relay may legitimately make every
    # occurrence (seen in a parallel CI run).  Every relay still raced for
    # it (passes > 0 above), and the occurrences below must be exact.
    if not database_url.startswith("sqlite"):
        assert sum(1 for _, _, made, _ in outcome if made > 0) >= 2

    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.id, job.c.schedule_id, job.c.nominal_fire_at)).all()
        final = {i.id: i for i in map(ScheduleInfo.from_row, conn.execute(sa.select(schedule)))}
    by_schedule: dict[Any, list[datetime]] = {sid: [] for sid in created}
    for row in rows:
        assert row.id == occurrences.occurrence_id(row.schedule_id, row.nominal_fire_at)
        by_schedule[row.schedule_id].append(row.nominal_fire_at)
    total = 0
    for sid, info in created.items():
        rule = info.rule
        cursor = final[sid].next_fire_at
        assert info.next_fire_at is not None
        assert cursor is not None
        # The cursor is exactly the first fire time past the end: nothing stalled.
        nxt = rule.next_after(end + timedelta(seconds=lookahead))
        assert nxt is not None
        assert cursor == nxt.at, info.name
        expected = []
        for fire in rule.fires_from(info.next_fire_at):
            if fire.at >= cursor:
                break
            expected.append(fire.at)
        got = sorted(by_schedule[sid])
        assert got == expected, (info.name, info.cron, info.timezone, info.fold)
        total += len(got)
    assert total == len(rows) > 2500
    app.dispose()
