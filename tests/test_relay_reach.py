"""How often the relay claims jobs coming within its reach (the claim's
horizon: kafka:// ``poll_interval + 1`` s, a broker's ceiling plus its hold
window elsewhere), on an injected clock and a broker with no native delay.

A trickle of jobs comes within reach one at a time.  Woken for each, the
relay ran one claim per job (kafka:// at 100 jobs/s: 4.5 ms of CPU per job,
bench/RESULTS.md); it now lets them gather for up to a poll interval (at
most half the reach), and still claims each long before its due time.  A
job already within reach is claimed at once: a backlog is never made to
wait.
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session
from test_catchup import T0, make

from duebox import FakeClock, JobState
from duebox.tables import job

JOBS = 200
EVERY = timedelta(milliseconds=10)  # 100 jobs/s
FIRST = timedelta(seconds=10)


async def test_a_trickle_coming_within_reach_is_claimed_together_and_in_time(
        database_url: str) -> None:
    clock = FakeClock(T0)
    app, relay, _ = make(database_url, clock, max_delay=0.0)  # kafka://: no native delay
    (pipeline,) = relay.pipelines
    reach = pipeline.horizon.reach()
    assert reach == app.settings.poll_interval + 1.0
    with Session(app.engine) as s, s.begin():
        app.schedule_many(s, [app.new_job("tick", {"n": i}, at=T0 + FIRST + i * EVERY)
                              for i in range(JOBS)])

    # The pipeline's own loop (Pipeline.run), on the fake clock: a pass, then
    # the wait it chooses, until every job has been claimed.
    passes = 0
    while passes < 10 * JOBS:
        await relay.run_pass()
        passes += 1
        with app.engine.connect() as conn:
            left = conn.execute(sa.select(sa.func.count()).select_from(job).where(
                job.c.state == JobState.SCHEDULED)).scalar_one()
        if not left:
            break
        wait = pipeline.seconds_until_next()
        assert wait >= 0
        clock.advance(max(wait, 0.001))
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.due_at, job.c.claimed_at)).all()

    assert len(rows) == JOBS
    assert all(r.claimed_at is not None for r in rows)
    claims = {r.claimed_at for r in rows}
    # Two seconds of trickle, gathered a poll interval at a time: a handful
    # of claims, not one per job.
    span = (JOBS * EVERY).total_seconds()
    assert len(claims) <= span / app.settings.poll_interval + 2, sorted(claims)
    # ... and each still claimed at least half the reach before its due time
    # (the held job's timer publishes it HANDOVER_LEAD_SECONDS before it).
    ahead = min((r.due_at - r.claimed_at).total_seconds() for r in rows)
    assert ahead >= reach / 2 - 1e-6, ahead


async def test_a_job_already_within_reach_is_claimed_at_once(database_url: str) -> None:
    clock = FakeClock(T0)
    app, relay, _ = make(database_url, clock, max_delay=0.0)
    (pipeline,) = relay.pipelines
    reach = pipeline.horizon.reach()
    assert reach is not None
    await relay.run_pass()  # its first recovery and sweeps done: nothing else is pending
    assert pipeline.seconds_until_next() > 0
    with Session(app.engine) as s, s.begin():
        # Just within reach: a slack added to it would put the claim off.
        app.schedule(s, "tick", {}, at=T0 + timedelta(seconds=reach - 0.1))
    # Not claimed yet (no pass since it was written): the next pass is now.
    assert pipeline.seconds_until_next() == 0.0
