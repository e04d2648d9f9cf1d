"""Per-queue broker routing (docs/brokers.md, "Routing"): settings, and jobs
on sql://, redis:// and amqp:// queues of one app at once, through one
relay and one worker, on the real services; a broker that does not answer
stalls only its own route."""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import helpers
import pytest
import sqlalchemy as sa
from backends import Keys, with_params
from conftest import reset_tables
from helpers import Running, check_no_early_start, job_row, make_app, schedule_committed

import duebox
from duebox import reroute
from duebox.brokers.amqp import AMQPBroker
from duebox.brokers.redis import RedisBroker
from duebox.brokers.routed import RoutedBroker
from duebox.brokers.sql import SQLBroker
from duebox.config import Settings
from duebox.errors import ConfigurationError
from duebox.processes import heartbeat
from duebox.relay import Relay
from duebox.relay.shards import ShardConfig
from duebox.routes import Routes
from duebox.tables import job

# --- settings -------------------------------------------------------------------------


def test_text_form_json_form_and_env() -> None:
    s = Settings(broker_routes="emails=redis://h/0?prefix=a, payments=amqp://u:pw@h/,"
                               "events=kafka://k1:9092,k2:9092")
    # A comma inside a URL (Kafka's bootstrap list) does not start an entry.
    assert s.routes == {"emails": "redis://h/0?prefix=a", "payments": "amqp://u:pw@h/",
                        "events": "kafka://k1:9092,k2:9092"}
    env = Settings.from_env({"DUEBOX_BROKER_ROUTES": '{"a=b": "redis://h/0"}'})
    assert env.routes == {"a=b": "redis://h/0"}
    assert Settings(broker_routes="").routes == {}
    assert Settings(broker_routes={"x": "amqp://h/"}).routes == {"x": "amqp://h/"}


@pytest.mark.parametrize(("value", "message"), [
    ("emails", "broker_routes: entry 1 ('emails') must be queue=URL"),
    ("emails=nope://x", "broker_routes: queue 'emails' -> nope://x: unknown scheme 'nope'"),
    ("a=redis://h/0,a=amqp://h/", "broker_routes: queue 'a': routed twice"),
    ('{"a": 1}', "broker_routes: queue 'a': must map a queue name to a non-empty broker URL"),
    ("{bad", "broker_routes: not a JSON object"),
    ("p=redis://h/0?max_delay=-1", "broker_routes: queue 'p' -> redis://h/0?max_delay=-1: "
                                   "max_delay must be a number of seconds >= 0"),
    ("a{b}=redis://h/0", "broker_routes: queue 'a{b}' -> redis://h/0: not a queue name "
                         "this broker can use (must not contain '{' or '}'"),
])
def test_bad_routes_name_the_queue_and_the_rule(value: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as exc:
        Settings(broker_routes=value)
    assert str(exc.value).startswith(message), str(exc.value)


DEEP = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize(("value", "message"), [
    ('{"a": "redis://h/0", "a": "amqp://h/"}', "broker_routes: queue 'a': routed twice"),
    ('{"a": "redis://h/0", "b": "amqp://h/", "b": "redis://h/0"}',
     "broker_routes: queue 'b': routed twice"),
    (DEEP, "broker_routes: must be a JSON object of queue name to broker URL string, with "
           "nothing nested in it"),
    ('{"a": {"b": "redis://h/0"}}', "broker_routes: must be a JSON object of queue name"),
    ("a=memory://x", "broker_routes: queue 'a' -> memory://x: memory:// keeps messages in "
                     "one process's memory"),
    ('{"a": "memory://"}', "broker_routes: queue 'a' -> memory://: memory:// keeps"),
])
def test_duplicate_deep_and_in_process_routes_are_refused_by_rule(value: str,
                                                                  message: str) -> None:
    """The JSON form kept the last of two routes for one queue (the text
    form refused them), 100,000-deep JSON raised a raw RecursionError, and a
    route to memory:// was accepted: its jobs would sit in the relay's own
    memory, where no worker process finds them."""
    for make in (lambda: Settings(broker_routes=value),
                 lambda: Settings.from_env({"DUEBOX_BROKER_ROUTES": value})):
        with pytest.raises(ConfigurationError) as exc:
            make()
        assert str(exc.value).startswith(message), str(exc.value)[:300]


@pytest.mark.parametrize("value", ['{"a": "redis://h/0", "a": "amqp://h/"}', DEEP,
                                   "a=memory://x"])
def test_the_cli_says_which_routes_are_refused_in_one_line(value: str, tmp_path: Any) -> None:
    from click.testing import CliRunner

    from duebox.cli.main import cli

    result = CliRunner().invoke(cli, ["routes"], env={
        "DUEBOX_DATABASE_URL": f"sqlite:///{tmp_path}/d.db", "DUEBOX_BROKER_ROUTES": value})
    assert result.exit_code == 1, (result.output[:300], result.exception)
    assert isinstance(result.exception, SystemExit), result.exception  # not a crash
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output[:300]
    assert lines[0].startswith("Error: ConfigurationError: broker_routes: "), lines[0][:300]


def test_errors_hide_passwords() -> None:
    with pytest.raises(ConfigurationError) as exc:
        Settings(broker_routes="p=amqp://user:s3cret@h/?max_delay=x")
    assert "s3cret" not in str(exc.value)
    assert "user:***@h" in str(exc.value)
    with pytest.raises(ConfigurationError) as exc:
        Settings(broker_routes="p amqp://user:s3cret@h/")
    assert "s3cret" not in str(exc.value)


def test_routes_group_queues_by_broker() -> None:
    routes = Routes.of("sql://", {"a": "redis://h/0", "b": "redis://h/0", "c": "amqp://h/",
                                  "d": "sql://"})
    assert routes.routed == {"a": "redis://h/0", "b": "redis://h/0", "c": "amqp://h/"}
    assert routes.url_for("d") == routes.url_for("zzz") == "sql://"
    assert routes.split(["z", "a", "c", "b"]) == {"sql://": ["z"], "redis://h/0": ["a", "b"],
                                                  "amqp://h/": ["c"]}
    default, redis, amqp = routes.all()
    assert default.default
    assert default.covers("z")
    assert not default.covers("a")
    assert redis.queues == ("a", "b")
    assert redis.covers("b")
    assert not redis.covers("z")
    assert amqp.url == "amqp://h/"


def test_app_brokers_per_queue(tmp_path: Any) -> None:
    app = duebox.Duebox(f"sqlite:///{tmp_path}/d.db", "sql://", settings=Settings(
        broker_routes={"emails": "redis://127.0.0.1:6379/0", "pay": "amqp://g:g@127.0.0.1/"}))
    assert isinstance(app.broker(), SQLBroker)
    assert isinstance(app.broker(queue="emails"), RedisBroker)
    assert isinstance(app.broker(queue="other"), SQLBroker)
    assert isinstance(app.broker(queues=["pay"]), AMQPBroker)
    both = app.broker(queues=["emails", "pay", "other"])
    assert isinstance(both, RoutedBroker)
    assert both.capabilities.name == "redis+amqp+sql"
    assert "g:***@" in both.url
    # A route must suit the queues of the tasks already declared.
    app.task("t", queue="a{b}")(lambda payload, ctx: None)  # fine on sql://
    with pytest.raises(duebox.ValidationError, match="queue: must not contain"):
        app.configure(broker_routes={"q": "redis://h/0"}, broker_url="redis://h/0")


# --- one app, three brokers, at once ----------------------------------------------------


def _route_tasks(app: duebox.Duebox, queues: list[str]) -> None:
    calls = app.calls  # type: ignore[attr-defined]
    for q in queues:
        @app.task(f"effect_{q}", queue=q)
        def effect(payload: Any, ctx: duebox.JobContext) -> None:
            calls.log.append((str(ctx.job_id), ctx.lease_generation))
            ctx.session.execute(helpers.effects.insert().values(helpers.effect_values(ctx)))


@pytest.fixture
def db_url(pg_server_url: str) -> str:
    reset_tables(pg_server_url)
    return pg_server_url


@pytest.fixture
def amqp_url(amqp_vhost: str) -> str:
    return with_params(amqp_vhost, prefix=f"t{uuid.uuid4().hex[:10]}")


@pytest.mark.postgres
async def test_sql_redis_and_amqp_queues_in_one_app(db_url: str, redis_keys: Keys,
                                                     amqp_url: str) -> None:
    """Contract-style: jobs on a sql:// queue (the default), a redis:// queue
    and an amqp:// queue, scheduled together and run by one relay and one
    worker: every job runs once, none early, each through its own broker."""
    app = make_app(db_url, "sql://", broker_routes={"emails": redis_keys.url(),
                                                    "payments": amqp_url})
    _route_tasks(app, ["emails", "payments"])
    tasks = {"default": "effect", "emails": "effect_emails", "payments": "effect_payments"}
    try:
        async with Running(app, relays=1, workers=1, concurrency=4) as r:
            assert isinstance(r.workers[0].broker, RoutedBroker)
            ids: dict[str, list[uuid.UUID]] = {q: [] for q in tasks}
            for i in range(30):
                for q, task in tasks.items():
                    ids[q].append(schedule_committed(app, task, delay=(i % 10) * 0.2))
            every = [j for js in ids.values() for j in js]
            await r.wait(lambda: all(job_row(app.engine, j).state == "SUCCEEDED"
                                     for j in every), timeout=60, what="every job ran")
        check_no_early_start(app.engine)
        assert sorted(helpers.effect_rows(app.engine)) == sorted(str(j) for j in every)
        assert all(app.calls.count(j) == 1 for j in every)  # type: ignore[attr-defined]
        # The relay published the routed queues' jobs, to their brokers;
        # sql:// jobs were claimed by the worker itself, never published.
        assert all(job_row(app.engine, j).published_at is None for j in ids["default"])
        assert all(job_row(app.engine, j).published_at is not None
                   for j in ids["emails"] + ids["payments"])
        client = redis_keys.client
        assert client.exists(redis_keys.k("ready", "emails"))
        assert not client.keys(f"{redis_keys.prefix}:{{payments}}:*")
        assert not client.keys(f"{redis_keys.prefix}:{{default}}:*")
    finally:
        app.dispose()


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """An AMQP URL whose server accepts connections and never answers (a
    hung broker): connecting, declaring and publishing there all stall."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"amqp://guest:guest@127.0.0.1:{s.getsockname()[1]}/"


@pytest.mark.postgres
async def test_a_stalled_broker_stalls_only_its_route(db_url: str, redis_keys: Keys) -> None:
    with black_hole() as hung:
        app = make_app(db_url, "sql://", broker_routes={"emails": redis_keys.url(),
                                                        "payments": hung})
        _route_tasks(app, ["emails", "payments"])
        try:
            async with Running(app, relays=1, workers=1, concurrency=4) as r:
                stuck = [schedule_committed(app, "effect_payments", delay=0.1)
                         for _ in range(5)]
                ok = [schedule_committed(app, t, delay=i * 0.1)
                      for i in range(10) for t in ("effect", "effect_emails")]
                await r.wait(lambda: all(job_row(app.engine, j).state == "SUCCEEDED"
                                         for j in ok), timeout=30,
                             what="the other routes' jobs ran")
                # The stalled route's jobs wait in the database, not lost.
                assert {job_row(app.engine, j).state for j in stuck} == {"SCHEDULED"}
            check_no_early_start(app.engine)
            assert all(app.calls.count(j) == 1 for j in ok)  # type: ignore[attr-defined]
        finally:
            app.dispose()


async def test_relay_pipelines_follow_the_routes(tmp_path: Any, redis_keys: Keys) -> None:
    """A relay with routes keeps recovery and schedules to itself and runs a
    pipeline per publishing route; the sql:// route gets none."""
    app = make_app(f"sqlite:///{tmp_path}/d.db", "sql://",
                   broker_routes={"emails": redis_keys.url()})
    try:
        relay = Relay(app)
        (pipeline,) = relay.pipelines
        assert isinstance(pipeline.broker, RedisBroker)
        assert pipeline.route.queues == ("emails",)
        info = relay._info()  # the registry row's
        assert info["backend"] == "routes"
        (shown,) = info["routes"]  # type: ignore[misc]
        assert shown["backend"] == "redis"
        assert shown["queues"] == ["emails"]
        assert relay.rerouting.active
        # A relay given its broker serves just that: it moves no job between routes.
        emails = app.broker(queue="emails")
        given = Relay(app, broker=emails)
        assert [p.broker for p in given.pipelines] == [emails]
        assert given.pipelines[0].route.covers("any queue")
        assert not given.rerouting.active
        with pytest.raises(ConfigurationError, match="shards"):
            Relay(app, shards=ShardConfig(2))
    finally:
        app.dispose()


# --- switching: the sweep ---------------------------------------------------------------


def _enqueue(app: duebox.Duebox, job_id: uuid.UUID, published_to: str | None,
             state: str = "ENQUEUED") -> None:
    with app.engine.begin() as conn:
        conn.execute(sa.update(job).where(job.c.id == job_id).values(
            state=state, published_to=published_to))


def test_sweep_moves_only_jobs_left_on_an_old_route(database_url: str) -> None:
    redis, amqp = "redis://u:pw@h/0", "amqp://g:g@h/"
    app = make_app(database_url, amqp, broker_routes={"emails": "sql://"})
    _route_tasks(app, ["emails"])
    moved_default, kept_default, running, unknown, moved_emails = (
        schedule_committed(app, t, delay=60) for t in
        ("effect", "effect", "effect", "effect", "effect_emails"))
    _enqueue(app, moved_default, reroute.route_key(redis))   # broker_url was redis
    _enqueue(app, kept_default, reroute.route_key(amqp))     # already on its route
    _enqueue(app, running, reroute.route_key(redis), "RUNNING")
    _enqueue(app, unknown, None)                             # marked before 0008
    _enqueue(app, moved_emails, reroute.route_key(amqp))     # emails now on sql://
    assert reroute.route_key(redis) == "redis://u:***@h/0"  # no secret in the table
    with app.engine.connect() as conn:
        left = reroute.leftovers(conn, app.routes)
    assert sorted((x.queue, x.published_to, x.route_now, x.jobs) for x in left) == [
        ("default", "redis://u:***@h/0", "amqp://g:***@h/", 1),
        ("emails", "amqp://g:***@h/", "sql://", 1)]
    with app.engine.begin() as conn:
        assert reroute.reroute(conn, routes=app.routes, now=app.clock.now(), limit=10) == 2
    for moved in (moved_default, moved_emails):
        row = job_row(app.engine, moved)
        assert (row.state, row.version, row.published_to) == ("SCHEDULED", 2, None)
    assert job_row(app.engine, kept_default).state == "ENQUEUED"
    assert job_row(app.engine, running).state == "RUNNING"
    assert job_row(app.engine, unknown).state == "ENQUEUED"
    with app.engine.begin() as conn:
        assert reroute.reroute(conn, routes=app.routes, now=app.clock.now(), limit=10) == 0
        assert reroute.leftovers(conn, app.routes) == []
    app.dispose()


def test_long_urls_get_a_digest_key() -> None:
    url = "amqp://u:pw@h/" + "v" * 300
    key = reroute.route_key(url)
    assert len(key) <= 255
    assert key.startswith("amqp://#")
    assert key != reroute.route_key(url + "x")


async def test_sweep_waits_while_a_relay_on_other_routes_is_alive(database_url: str) -> None:
    """Mid-deploy, a relay on the old settings would move the jobs back each
    minute: a relay on the new ones leaves them until it is gone."""
    old = make_app(database_url, "sql://", broker_routes={"emails": "redis://h/0"})
    new = make_app(database_url, "sql://", broker_routes={"emails": "amqp://h/"})
    _route_tasks(new, ["emails"])
    job_id = schedule_committed(new, "effect_emails", delay=60)
    _enqueue(new, job_id, reroute.route_key("redis://h/0"))
    old_relay, new_relay = Relay(old), Relay(new)
    assert old_relay._info()["routing"] != new_relay._info()["routing"]
    with new.engine.begin() as conn:
        heartbeat.beat(conn, name="relay:old-one", now=new.clock.now(), ttl=60,
                       info=old_relay._info())
    assert await new_relay.rerouting.step() == 0
    assert job_row(new.engine, job_id).state == "ENQUEUED"
    with new.engine.begin() as conn:
        heartbeat.remove(conn, name="relay:old-one")
    new_relay.rerouting.pending = True  # look again now, not in a minute
    assert await new_relay.rerouting.step() == 1
    assert job_row(new.engine, job_id).state == "SCHEDULED"
    for app in (old, new):
        app.dispose()


# --- many routes, one relay -------------------------------------------------------------

# What a relay may hold, however many routes it has: its engine's pool
# (create_sync_engine's pool_size 10 + max_overflow 20), shared by every
# route's lane, plus the one LISTEN connection (PostgreSQL's NOTIFY wake-up)
# and the liveness lock's.  docs/brokers.md, "Routing".
MOST_CONNECTIONS = 10 + 20 + 2


def _relay_connections(pg_server_url: str, redis_keys: Keys, tmp_path: Any,
                       routes: int) -> tuple[int, str]:
    """A real ``duebox relay`` with ``routes`` redis:// routes: the most
    connections it held at once over 3 s of running, and its log."""
    import os
    import subprocess
    import sys
    import time

    from backends import REDIS, ROOT, poll, stop_processes

    tag = f"duebox-routes-{uuid.uuid4().hex[:8]}"
    routed = {f"q{i}": with_params(REDIS, prefix=f"{redis_keys.prefix}r{i}")
              for i in range(routes)}
    env = {**os.environ, "DUEBOX_DATABASE_URL": with_params(pg_server_url, application_name=tag),
           "DUEBOX_BROKER_ROUTES": ",".join(f"{q}={u}" for q, u in routed.items())}
    log = tmp_path / f"relay-{routes}.log"
    watcher = sa.create_engine(pg_server_url)
    with log.open("wb") as out:
        relay = subprocess.Popen([sys.executable, "-m", "duebox", "relay"], env=env, cwd=ROOT,
                                 stdout=out, stderr=subprocess.STDOUT)
    try:
        def alive() -> None:
            assert relay.poll() is None, log.read_text()

        poll("the relay started", lambda: " started" in log.read_text(), 60, check=alive)
        most = 0
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            with watcher.connect() as conn:
                held = conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity "
                                            "WHERE application_name = :tag"), {"tag": tag})
                most = max(most, int(held.scalar_one()))
            alive()
            time.sleep(0.1)
    finally:
        stop_processes([relay], timeout=30)
        watcher.dispose()
        for key in redis_keys.client.scan_iter(match=f"{redis_keys.prefix}r*"):
            redis_keys.client.delete(key)
    assert relay.returncode == 0, log.read_text()[-3000:]
    return most, log.read_text()


@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_a_relay_with_many_routes_holds_a_bounded_number_of_connections(
        pg_server_url: str, redis_keys: Keys, tmp_path: Any) -> None:
    """Each route's lane opened a LISTEN connection of its own: 7 / 19 / 49
    connections for 1 / 10 / 40 routes, and 1,000 routes took all 400 of a
    shared server's; each lane also logged its own start and stop.  Now the
    lanes follow their relay's one LISTEN connection and share its pool."""
    reset_tables(pg_server_url)
    few, _ = _relay_connections(pg_server_url, redis_keys, tmp_path, 1)
    many, log = _relay_connections(pg_server_url, redis_keys, tmp_path, 40)
    assert few > 0, few
    assert many <= MOST_CONNECTIONS, (few, many)
    lines = log.strip().splitlines()
    assert sum(" started" in line for line in lines) == 1, log
    assert sum(" stopped" in line for line in lines) == 1, log
    assert len(lines) <= 5, log  # the start and stop lines, one about new broker state
