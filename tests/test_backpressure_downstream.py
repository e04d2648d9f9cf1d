"""Backpressure from downstream: handlers failing as throttled (a 429 from
the API they call) slow the relay's dispatch, as a broker's overload does."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from conftest import reset_tables
from helpers import Running, make_app, memory_url

import duebox
from duebox.processes.heartbeat import ProcessRow, beat
from duebox.relay import Relay
from duebox.relay.scale import ScaleControls


def worker_row(name: str, throttled: int | None) -> ProcessRow:
    info: dict[str, Any] = {} if throttled is None else {"throttled": throttled}
    now = datetime.now(UTC)
    return ProcessRow(name=f"worker:{name}", role="worker", heartbeat_at=now, expires_at=now,
                      info=info)


def test_a_rising_throttled_count_halves_dispatch_and_holds_it(tmp_path: Any) -> None:
    app = duebox.Duebox(f"sqlite:///{tmp_path}/d.db", "sql://")
    scale = ScaleControls(app, None, None)
    bp = scale.backpressure
    scale.observe_workers([worker_row("a", 3), worker_row("b", None)], interval=60)
    assert bp.factor == 1.0  # first sight of a count: nothing to compare with
    scale.observe_workers([worker_row("a", 3), worker_row("b", None)], interval=60)
    assert bp.factor == 1.0  # unchanged
    scale.observe_workers([worker_row("a", 5), worker_row("b", None)], interval=60)
    assert bp.factor == 0.5
    for _ in range(20):  # calm publishes: the broker is fine, the downstream is not
        bp.observe(10, 0.01)
    assert bp.factor == 0.5
    scale.observe_workers([worker_row("a", 9)], interval=0.0)
    assert bp.factor == 0.25
    bp.observe(10, 0.01)  # the hold is over (interval 0): calm publishes grow it back
    assert bp.factor > 0.25


async def test_throttled_handlers_slow_the_relay_down(database_url: str) -> None:
    app = make_app(database_url, memory_url())

    @app.task("rate_limited_api", max_attempts=100)
    def call_api(payload: Any, ctx: duebox.JobContext) -> None:
        raise duebox.Throttled("429 Too Many Requests", retry_after=0.05)

    try:
        with app.engine.begin() as conn:
            app.schedule_many(conn, [app.new_job("rate_limited_api", i) for i in range(20)])
        async with Running(app, relays=1, workers=1,
                           relay_kw={"collect_interval": 0.2},
                           worker_kw={"heartbeat_interval": 0.2}) as r:
            relay = r.relays[0]
            (pipeline,) = relay.pipelines
            await r.wait(lambda: pipeline.scale.backpressure.factor < 1.0, timeout=30,
                         what="the relay to slow down on the workers' throttled count")
            assert r.worker_total("throttled") > 0
            await r.wait(
                lambda: relay.metrics.sample("duebox_relay_backpressure_factor") < 1.0,
                timeout=10, what="the backpressure gauge to follow")
    finally:
        await app.adispose()


def test_with_routes_every_pipeline_slows_down(tmp_path: Any) -> None:
    """A relay with broker_routes read the workers' throttled count into a
    backpressure none of its routes used: each route's pipeline slows down."""
    url = f"sqlite:///{tmp_path}/d.db"
    reset_tables(url)
    app = duebox.Duebox(url, "sql://", settings=duebox.Settings(broker_routes={
        "a": "redis://127.0.0.1:6379/0", "b": "amqp://g:g@127.0.0.1/"}))
    try:
        relay = Relay(app)
        assert len(relay.pipelines) == 2  # sql://, the default route, has none
        for throttled in (3, 5):  # first sight, then a rise
            with app.engine.begin() as conn:
                beat(conn, name="worker:w", now=app.clock.now(), ttl=60,
                     info={"throttled": throttled})
            assert relay.heartbeat.tick is not None
            relay.heartbeat.tick()  # the relay's periodic snapshot
        assert [p.scale.backpressure.factor for p in relay.pipelines] == [0.5, 0.5]
    finally:
        app.dispose()
