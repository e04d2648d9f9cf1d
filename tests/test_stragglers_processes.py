"""A slow handler never holds a fast job back, across real worker processes
(issue #32): ``duebox worker --processes 2`` started as an operator starts
it, slow and hanging jobs among fast ones of the same task, and the process
running a slow job really killed.

The slow handlers block until the test creates a file (tests/apps/
procs_app.py, ``wait_for``): a straggler is a handler not released yet,
whatever the machine's speed.  Leases are 300 s, so nothing here waits for
one to expire.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from helpers import check_no_early_start, effect_rows
from test_worker_processes import (
    Supervised,
    calls,
    fleets,  # noqa: F401 - the fixture
    kill_broker_url,  # noqa: F401 - the fixture
    pg,  # noqa: F401 - the fixture
    scene,
    states,
)

import duebox
from duebox.tables import job

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(params=["sql", "redis", "amqp"])
def any_broker_url(request: pytest.FixtureRequest) -> str:
    from test_worker_processes import _broker

    return _broker(request)


def _schedule(app: duebox.Duebox, payloads: list[dict[str, object]]) -> list[uuid.UUID]:
    """Jobs of one task, due now, in this order."""
    with app.engine.begin() as conn:
        ids = app.schedule_many(conn, [app.new_job("procs.effect", p) for p in payloads])
    assert isinstance(ids, list)
    return ids


def _state(app: duebox.Duebox, job_id: uuid.UUID) -> str:
    with app.engine.connect() as conn:
        return str(conn.execute(sa.select(job.c.state).where(job.c.id == job_id)).scalar_one())


def _all(app: duebox.Duebox, ids: list[uuid.UUID], state: str) -> bool:
    with app.engine.connect() as conn:
        n = conn.execute(sa.select(sa.func.count()).select_from(job)
                         .where(job.c.id.in_(ids), job.c.state == state)).scalar_one()
    return int(n) == len(ids)


async def test_slow_and_hanging_handlers_hold_only_their_own_jobs(
        pg: str, any_broker_url: str, tmp_path: Path,  # noqa: F811
        fleets: list[Supervised]) -> None:  # noqa: F811
    """Two processes of four threads, their handlers known to be short (a
    warm-up); then three blocked handlers — one never released — among 60
    fast jobs of the same task due with them: every fast job finishes while
    they block, and each ran once."""
    release, never = tmp_path / "release", tmp_path / "never"
    async with scene(pg, any_broker_url, tmp_path, fleets,
                     args=("--concurrency=4",)) as (app, fleet, relay, _):
        warm = _schedule(app, [{}] * 40)
        await relay.wait(lambda: _all(app, warm, "SUCCEEDED"), timeout=120,
                         what="the warm-up jobs")
        blocked = [{"wait_for": str(release)}] * 2 + [{"wait_for": str(never)}]
        slow = _schedule(app, blocked)
        fast = _schedule(app, [{}] * 60)
        await relay.wait(lambda: _all(app, fast, "SUCCEEDED"), timeout=120,
                         what="every fast job to finish while three handlers block")
        assert not release.exists()
        assert all(_state(app, j) == "RUNNING" for j in slow), [_state(app, j) for j in slow]
        with app.engine.begin() as conn:  # the hanging one: the cancel wins at once
            conn.exec_driver_sql("SET LOCAL lock_timeout = '2s'")
            assert app.cancel(conn, slow[2])
        release.touch()
        await relay.wait(lambda: _all(app, slow[:2], "SUCCEEDED"), timeout=120,
                         what="the released handlers to finish")
        never.touch()  # a stop waits for the handlers it started
        assert fleet.stop() == 0, fleet.log()
    assert _state(app, slow[2]) == "CANCELLED"
    ran = calls(fleet)
    assert {str(j) for j in warm + fast + slow} == set(ran)
    assert all(n == 1 for n in ran.values()), ran
    assert set(effect_rows(app.engine)) == {str(j) for j in warm + fast + slow[:2]}
    check_no_early_start(app.engine)


async def test_a_killed_process_running_a_slow_job_holds_nothing_back(
        pg: str, kill_broker_url: str, tmp_path: Path,  # noqa: F811
        fleets: list[Supervised]) -> None:  # noqa: F811
    """The process running a slow handler is killed (SIGKILL): the fast jobs
    finish, the slow job runs again — in another process, or the one its
    supervisor starts — and takes effect once."""
    release = tmp_path / "release"
    async with scene(pg, kill_broker_url, tmp_path, fleets,
                     args=("--concurrency=4",)) as (app, fleet, relay, _):
        warm = _schedule(app, [{}] * 40)
        await relay.wait(lambda: _all(app, warm, "SUCCEEDED"), timeout=120,
                         what="the warm-up jobs")
        slow = _schedule(app, [{"wait_for": str(release)}])
        fast = _schedule(app, [{}] * 60)
        runs = await relay.wait(
            lambda: [int(line.split()[1]) for line in fleet.calls.read_text().splitlines()
                     if line.split()[0] == str(slow[0])], timeout=120,
            what="the slow handler to start")
        os.kill(runs[0], signal.SIGKILL)
        await relay.wait(lambda: _all(app, fast, "SUCCEEDED"), timeout=120,
                         what="every fast job to finish")
        await relay.wait(lambda: calls(fleet)[str(slow[0])] >= 2, timeout=120,
                         what="the killed slow handler to start again")
        release.touch()
        await relay.wait(lambda: _all(app, slow, "SUCCEEDED"), timeout=120,
                         what="the slow job to finish")
        assert fleet.stop() == 0, fleet.log()
    assert set(effect_rows(app.engine)) == {str(j) for j in warm + fast + slow}
    # A handler runs again only if the killed process had called it (its
    # transaction died with it: docs/worker.md, "What repeats after a crash").
    by_killed = {line.split()[0] for line in fleet.calls.read_text().splitlines()
                 if int(line.split()[1]) == runs[0]}
    again = {j for j, n in calls(fleet).items() if n > 1}
    assert again <= by_killed, (again - by_killed)
    assert states(app)["SUCCEEDED"] == len(warm + fast + slow)
    check_no_early_start(app.engine)
