"""Switching a queue's broker in place (docs/brokers.md, "Switching a
queue's broker"): queue ``emails`` moves from Redis to RabbitMQ while 1,000
of its jobs are due over the next minute, most of them already handed to
Redis.  The relay on the old routes stops, one on the new routes starts; a
worker on the old routes keeps consuming Redis throughout (a rolling
deploy), beside one on the new routes.  None is lost, none runs twice,
none early; the old copies left on Redis are discarded as stale; ``duebox
routes`` shows the jobs left on the old route until the new relay moved
them."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from datetime import timedelta
from typing import Any

import pytest
from backends import Keys, with_params
from click.testing import CliRunner
from conftest import reset_tables
from helpers import check_no_early_start, count, effect_values, effects, make_app, wait_for

import duebox
from duebox import reroute
from duebox.cli.main import cli
from duebox.consumers import Worker
from duebox.relay import Relay
from duebox.states import Discard

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

JOBS = 1_000
SPREAD = 60.0


def _emails_task(app: duebox.Duebox) -> None:
    calls = app.calls  # type: ignore[attr-defined]

    @app.task("send", queue="emails")
    def send(payload: Any, ctx: duebox.JobContext) -> None:
        calls.log.append((str(ctx.job_id), ctx.lease_generation))
        ctx.session.execute(effects.insert().values(effect_values(ctx)))


def _states(app: duebox.Duebox) -> dict[str, int]:
    with app.engine.connect() as conn:
        return {str(k): v for k, v in duebox.leases.jobstore.counts_by_state(conn).items()}


def _routes_cli(db_url: str, routes: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["routes", "--json"], env={
        "DUEBOX_DATABASE_URL": db_url, "DUEBOX_BROKER_URL": "sql://",
        "DUEBOX_BROKER_ROUTES": routes})
    return result.exit_code, json.loads(result.output)


async def test_switch_redis_to_amqp_with_1000_jobs(pg_server_url: str, redis_keys: Keys,
                                                   amqp_vhost: str) -> None:
    reset_tables(pg_server_url)
    redis_url = redis_keys.url()
    amqp_url = with_params(amqp_vhost, prefix=f"t{uuid.uuid4().hex[:10]}")
    old = make_app(pg_server_url, "sql://", broker_routes={"emails": redis_url})
    new = make_app(pg_server_url, "sql://", broker_routes={"emails": amqp_url})
    for app in (old, new):
        _emails_task(app)
    rnd = random.Random(21)
    now = old.clock.now()
    jobs = [old.new_job("send", {"n": i}, at=now + timedelta(seconds=2 + rnd.random() * SPREAD))
            for i in range(JOBS)]
    with old.engine.begin() as conn:
        ids = old.schedule_many(conn, jobs)

    stop_old_relay, stop_all = asyncio.Event(), asyncio.Event()
    old_worker = Worker(old, concurrency=8, queues=["emails"])
    new_worker = Worker(new, concurrency=8, queues=["emails"])
    tasks = [asyncio.create_task(Relay(old, recover_interval=0.1).run(stop_old_relay)),
             asyncio.create_task(old_worker.run(stop_all))]

    def check() -> None:
        for t in tasks:
            if t.done():
                t.result()
                raise AssertionError("a relay or worker stopped on its own")

    def succeeded() -> int:
        return _states(old).get("SUCCEEDED", 0)

    try:
        # The old relay hands (nearly) every job to Redis at once (its delay
        # has no ceiling); some run there before the switch.
        await wait_for(lambda: succeeded() >= 20 and _states(old).get("SCHEDULED", 0) == 0,
                       timeout=30, what="jobs handed to Redis, some run", check=check)
        stop_old_relay.set()
        await tasks.pop(0)

        # Before any relay on the new routes ran: the jobs still on Redis.
        code, shown = await asyncio.to_thread(_routes_cli, pg_server_url,
                                              f"emails={amqp_url}")
        assert code == 1
        assert shown["routes"]["emails"] == reroute.route_key(amqp_url)
        (left,) = shown["leftovers"]
        assert left["published_to"] == reroute.route_key(redis_url)
        on_redis = left["jobs"]
        assert on_redis >= JOBS // 2

        tasks += [asyncio.create_task(Relay(new, recover_interval=0.1).run(stop_all)),
                  asyncio.create_task(new_worker.run(stop_all))]
        await wait_for(lambda: succeeded() == JOBS, timeout=SPREAD + 60, interval=0.5,
                       what="every job ran", check=check)
        code, shown = await asyncio.to_thread(_routes_cli, pg_server_url,
                                              f"emails={amqp_url}")
        assert code == 0
        assert shown["leftovers"] == []
        # The old copies on Redis came due at the old worker and were
        # discarded there as stale: the move bumped each job's version.
        await wait_for(lambda: old_worker.stats.discarded[Discard.STALE_VERSION] > 0,
                       timeout=10, what="stale copies discarded", check=check)
    finally:
        stop_old_relay.set()
        stop_all.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for app in (old, new):
            app.dispose()
    for r in results:
        if isinstance(r, BaseException):
            raise r

    assert _states(old) == {"SUCCEEDED": JOBS}
    assert count(old.engine, "effects") == JOBS  # none ran twice in effect
    runs: dict[str, int] = {}
    for app in (old, new):
        for job_id, _ in app.calls.log:  # type: ignore[attr-defined]
            runs[job_id] = runs.get(job_id, 0) + 1
    assert runs == {str(i): 1 for i in ids}  # no handler called twice either
    check_no_early_start(old.engine)
    assert new_worker.stats.succeeded > 0
    print(f"{on_redis} jobs on Redis at the switch; old worker ran "
          f"{old_worker.stats.succeeded}, discarded {dict(old_worker.stats.discarded)}; "
          f"new worker ran {new_worker.stats.succeeded}")
