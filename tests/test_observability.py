"""Metrics, the process registry and ``duebox status``, against real databases."""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from helpers import Running, make_app, memory_url, schedule_committed

import duebox
from duebox.cli.main import cli
from duebox.metrics import DBCollector, Metrics, serve
from duebox.processes import heartbeat
from duebox.tables import job, lease

N = 5


def _add_failing_task(app: duebox.Duebox) -> None:
    @app.task("boom")
    def boom(payload: Any, ctx: duebox.JobContext) -> None:
        raise duebox.Permanent("no such customer")


def _lease_names(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(lease.c.name)).scalars())



async def test_a_beat_still_running_at_stop_cannot_write_the_row_again(database_url: str) -> None:
    """A stop cancels the heartbeat task, but a beat already in its thread goes
    on: it must not recreate the row the stop deletes (seen in a full run: a
    worker's row left behind after a clean stop)."""
    app = make_app(database_url, memory_url())
    entered, go_on = threading.Event(), threading.Event()

    def slow_info() -> dict[str, Any]:
        if not entered.is_set():  # the first beat after register() waits
            entered.set()
            go_on.wait(10)
        return {}

    hb = heartbeat.ProcessHeartbeat(app.engine, app.clock, role="worker", name="w#slow",
                                    info=dict)
    try:
        hb.register()
        assert _lease_names(app.engine) == {hb.name}
        hb.info = slow_info
        beating = threading.Thread(target=hb.beat_once)
        beating.start()
        assert entered.wait(10)
        removing = threading.Thread(target=hb.remove_once)
        removing.start()
        removing.join(0.3)  # the delete waits for the beat (or, unfixed, runs first)
        go_on.set()
        beating.join(10)
        removing.join(10)
        assert _lease_names(app.engine) == set()
    finally:
        go_on.set()
        app.dispose()


@pytest.mark.parametrize("broker", ["memory", "sql"])
async def test_metrics_move_when_the_system_does(database_url: str, broker: str) -> None:
    app = make_app(database_url, memory_url() if broker == "memory" else "sql://")
    _add_failing_task(app)
    m = Metrics()
    fast = {"metrics": m, "heartbeat_interval": 0.1}
    try:
        ok = [schedule_committed(app, payload={"i": i}) for i in range(N)]
        bad = schedule_committed(app, "boom")
        running = Running(app, relay_kw={**fast, "collect_interval": 0.1}, worker_kw=fast)
        async with running as r:
            labels = {"backend": broker, "queue": "default"}
            await r.wait(lambda: m.sample("duebox_jobs_succeeded_total", labels) == N
                         and m.sample("duebox_jobs_dead_total",
                                      {**labels, "failure_class": "permanent"}) == 1,
                         timeout=20, what="every job to finish")
            names = await r.wait(lambda: {n.split(":")[0] for n in _lease_names(app.engine)}
                                 == {"relay", "worker"} and _lease_names(app.engine),
                                 timeout=10, what="relay and worker heartbeat rows")
            assert {r.relays[0].heartbeat.name, r.workers[0].heartbeat.name} == names
            await r.wait(lambda: m.sample("duebox_live_processes", {"role": "worker"}) == 1,
                         timeout=10, what="the collector to see the live worker")
        # a clean stop deletes the registry rows
        assert _lease_names(app.engine) == set()

        dead = {**labels, "failure_class": "permanent"}
        assert m.sample("duebox_jobs_failed_total", dead) == 1
        assert m.sample("duebox_jobs_retried_total", labels) == 0
        assert m.sample("duebox_jobs_lease_lost_total", labels) == 0
        assert m.sample("duebox_start_lateness_seconds_count", labels) == N + 1
        assert m.sample("duebox_queue_wait_seconds_count", labels) == N + 1
        assert m.sample("duebox_end_to_end_latency_seconds_count", labels) == N
        assert m.sample("duebox_execution_duration_seconds_count",
                        {**labels, "outcome": "succeeded"}) == N
        assert m.sample("duebox_execution_duration_seconds_count",
                        {**labels, "outcome": "dead"}) == 1
        assert m.sample("duebox_start_lateness_seconds_sum", labels) >= 0
        assert m.sample("duebox_worker_deliveries_total", {"backend": broker}) == N + 1
        assert m.sample("duebox_relay_passes_total", {"backend": broker}) >= 1
        relayed = N + 1 if broker == "memory" else 0  # sql:// workers claim rows directly
        assert m.sample("duebox_relay_jobs_claimed_total", labels) == relayed
        assert m.sample("duebox_relay_jobs_published_total", labels) == relayed
        # A fast worker may start a job before the relay's mark lands: that
        # mark then matches nothing and counts as lost (harmless).
        assert (m.sample("duebox_relay_jobs_marked_total", {"backend": broker})
                + m.sample("duebox_relay_lost_marks_total", {"backend": broker})) == relayed
        assert m.sample("duebox_scheduling_lag_seconds_count", labels) == relayed
        assert m.sample("duebox_dispatch_lag_seconds_count", {"backend": broker}) == relayed
        assert bad not in ok
    finally:
        await app.adispose()


async def test_duplicate_delivery_is_counted_with_its_reason(database_url: str) -> None:
    """A second delivery of a finished job is discarded and counted as a
    duplicate, labelled with the version check's reason."""
    from duebox.brokers.base import Delivery

    app = make_app(database_url, memory_url())
    m = Metrics()
    try:
        job_id = schedule_committed(app)
        async with Running(app, relay_kw={"metrics": m}, worker_kw={"metrics": m}) as r:
            await r.wait(lambda: m.sample("duebox_jobs_succeeded_total",
                                          {"backend": "memory", "queue": "default"}) == 1,
                         timeout=20, what="the job to run")
            with app.engine.connect() as conn:
                row = conn.execute(sa.select(job).where(job.c.id == job_id)).one()
            msg = duebox.JobMessage(job_id=job_id, task="effect", queue="default",
                                    version=row.version, attempt=1, due_at=row.due_at,
                                    payload=None, headers={})
            await r.workers[0].handle(Delivery(message=msg))
        assert m.sample("duebox_jobs_duplicates_total",
                        {"backend": "memory", "reason": "already_succeeded"}) == 1
        assert m.sample("duebox_jobs_discarded_total",
                        {"backend": "memory", "reason": "already_succeeded"}) == 1
    finally:
        await app.adispose()


def _set(engine: sa.Engine, job_id: uuid.UUID, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(sa.update(job).where(job.c.id == job_id).values(**values))


def _constructed_state(database_url: str) -> tuple[duebox.Duebox, datetime]:
    """Due backlog default 2 (tenant acme) + other 1 (tenant beta), one
    future job, one RUNNING (2 s late), one SUCCEEDED (1 s late), one DEAD;
    a live relay, a stale relay row, a live worker and an unrelated lease."""
    app = make_app(database_url)
    eng = app.engine
    now = datetime.now(UTC)
    for i in range(2):
        jid = schedule_committed(app, tenant="acme")
        _set(eng, jid, due_at=now - timedelta(seconds=30 + i))
    jid = schedule_committed(app, "noop", tenant="beta")
    _set(eng, jid, due_at=now - timedelta(seconds=120))
    schedule_committed(app, delay=3600, tenant="acme")
    jid = schedule_committed(app, tenant="acme")
    _set(eng, jid, state="RUNNING", due_at=now - timedelta(seconds=3),
         started_at=now - timedelta(seconds=1), lease_until=now + timedelta(seconds=60))
    jid = schedule_committed(app)
    _set(eng, jid, state="SUCCEEDED", due_at=now - timedelta(seconds=10),
         started_at=now - timedelta(seconds=9), finished_at=now - timedelta(seconds=8))
    jid = schedule_committed(app)
    _set(eng, jid, state="DEAD", due_at=now - timedelta(seconds=50),
         started_at=now - timedelta(seconds=49), finished_at=now - timedelta(seconds=40),
         error_class="permanent")
    with eng.begin() as conn:
        heartbeat.beat(conn, name="relay:live", now=now, ttl=30, info={"backend": "memory"})
        heartbeat.beat(conn, name="relay:stale", now=now - timedelta(minutes=5), ttl=15,
                       info={"backend": "memory"})
        heartbeat.beat(conn, name="worker:live", now=now - timedelta(seconds=2), ttl=30,
                       info={"backend": "memory"})
        conn.execute(lease.insert().values(name="shard:0", owner="x", epoch=3,
                                           expires_at=now - timedelta(minutes=5)))
    return app, now


def test_db_collector_gauges_match_the_table(database_url: str) -> None:
    app, now = _constructed_state(database_url)
    m = Metrics()
    try:
        assert m.sample("duebox_due_backlog_jobs", {"queue": "default"}) == 0  # no snapshot yet
        DBCollector(m, overdue_after=60).collect(app.engine, now)
        assert m.sample("duebox_due_backlog_jobs", {"queue": "default"}) == 2
        assert m.sample("duebox_due_backlog_jobs", {"queue": "other"}) == 1
        assert m.sample("duebox_overdue_jobs", {"queue": "other"}) == 1
        assert m.sample("duebox_overdue_jobs", {"queue": "default"}) == 0
        assert m.sample("duebox_oldest_due_age_seconds", {"queue": "default"}) == 31
        assert m.sample("duebox_outbox_publication_lag_seconds") == 120
        assert m.sample("duebox_in_flight_jobs", {"queue": "default", "state": "RUNNING"}) == 1
        assert m.sample("duebox_dlq_jobs", {"queue": "default"}) == 1
        assert m.sample("duebox_dlq_oldest_age_seconds", {"queue": "default"}) == 40
        assert m.sample("duebox_tenant_due_backlog_jobs", {"tenant": "acme"}) == 2
        assert m.sample("duebox_tenant_due_backlog_jobs", {"tenant": "beta"}) == 1
        assert m.sample("duebox_live_processes", {"role": "relay"}) == 1
        assert m.sample("duebox_live_processes", {"role": "worker"}) == 1
        assert m.sample("duebox_heartbeat_age_seconds_max", {"role": "worker"}) == 2
        # the relay's pruning removes the stale process row, not other leases
        with app.engine.begin() as conn:
            assert heartbeat.prune(conn, now=now) == 1
        assert _lease_names(app.engine) == {"relay:live", "worker:live", "shard:0"}
    finally:
        app.dispose()


def test_status_json_matches_a_constructed_state(database_url: str) -> None:
    app, _ = _constructed_state(database_url)
    app.dispose()
    result = CliRunner().invoke(cli, ["status", "--json", "--database-url", database_url])
    assert result.exit_code == 4, result.output  # unhealthy: probes and cron alerts see it
    report = json.loads(result.output)
    default, other = report["queues"]["default"], report["queues"]["other"]
    assert (default["due_backlog"], other["due_backlog"]) == (2, 1)
    assert default["in_flight"] == 1
    assert default["in_flight_by_state"] == {"RUNNING": 1}
    assert (default["dlq"], other["dlq"]) == (1, 0)
    assert default["started_recently"] == 3
    assert default["lateness_p50_s"] == pytest.approx(1.0)
    assert default["lateness_p99_s"] == pytest.approx(2.0)
    assert 120 <= other["oldest_due_age_s"] < 150
    acme, beta = report["tenants"]["acme"], report["tenants"]["beta"]
    assert (acme["due_backlog"], acme["in_flight"], beta["due_backlog"]) == (2, 1, 1)
    assert [p["name"] for p in report["relays"]] == ["relay:live"]  # stale row ignored
    assert [p["name"] for p in report["workers"]] == ["worker:live"]
    assert 2 <= report["workers"][0]["heartbeat_age_s"] < 30
    assert report["states"] == {"SCHEDULED": 4, "RUNNING": 1, "SUCCEEDED": 1, "DEAD": 1}
    assert not report["healthy"]  # queue other waited 120 s > 60 s
    assert (report["verdict"], report["exit_code"]) == ("unhealthy", 4)
    assert any("queue other" in p for p in report["problems"])
    assert any("dead-lettered" in w for w in report["warnings"])


def test_status_watch_refreshes_then_stops(database_url: str) -> None:
    app, _ = _constructed_state(database_url)
    app.dispose()
    result = CliRunner().invoke(cli, ["status", "--database-url", database_url,
                                      "--watch", "0.1", "--iterations", "2"])
    assert result.exit_code == 4, result.output  # the last report's verdict
    assert result.output.count("duebox status at") == 2
    assert "relays alive: 1" in result.output
    assert "relay:live" in result.output
    assert "relay:stale" not in result.output
    assert "acme" in result.output


def test_metrics_endpoint_serves_text() -> None:
    m = Metrics()
    m.succeeded.labels("memory", "default").inc(3)
    server = serve(m, 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read().decode()
            ctype = resp.headers["Content-Type"]
    finally:
        server.shutdown()
        server.server_close()
    assert ctype.startswith("text/plain")
    assert 'duebox_jobs_succeeded_total{backend="memory",queue="default"} 3.0' in body
    assert "# TYPE duebox_start_lateness_seconds histogram" in body


def test_relay_and_worker_commands_take_metrics_options() -> None:
    for command in ("relay", "worker"):
        result = CliRunner().invoke(cli, [command, "--help"])
        assert "--metrics-port" in result.output
        assert "DUEBOX_METRICS_PORT" in result.output
