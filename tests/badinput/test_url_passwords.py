"""A password in a URL reaches no output, whatever its characters (issue 36).

The old redaction read a URL the way ``urllib`` does, which ends the user
and password at the first ``/``, ``?`` or ``#``: a password holding one
(AWS secrets often hold ``/``) was printed whole by route errors, ``duebox
routes``, ``duebox status``, the relay's start-up line and the job table's
``published_to``.  Every password here is ``Zq7<c>Xw9``: neither half may
appear in anything duebox prints, logs, serves or stores.

A broker URL whose password holds a raw ``/``, ``?`` or ``#`` is refused
(its clients would connect to a host made of half the password); a raw
``@`` and a percent-encoded password work and are hidden.  A database URL
is read by SQLAlchemy, which takes ``/``, ``?`` and ``#`` in a password, so
such a database URL works (and is hidden); a raw ``@`` in it is refused.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import REDIS, ROOT, Keys, poll, stop_processes
from click.testing import CliRunner
from conftest import PG_ADMIN_URL
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.orm import Session

import duebox
from duebox import ConfigurationError, migrate
from duebox.cli.main import cli
from duebox.reroute import route_key
from duebox.routes import Route
from tests.dashboard.procs import dashboard_process

from .common import scratch_database, snapshot

HALVES = ("Zq7", "Xw9")
APP = ["--app", "tests.apps.routes_app:app"]


def leaked(text: str) -> list[str]:
    return [half for half in HALVES if half in text]


def password(c: str) -> str:
    return f"{HALVES[0]}{c}{HALVES[1]}"


# --- the rule, on any password ----------------------------------------------------

# A password holding whitespace and then ``scheme://`` is cut there (a message
# may quote several URLs): the one shape credentials.py cannot tell apart.
_ANOTHER_URL = re.compile(r"\s[A-Za-z][A-Za-z0-9+.-]*://")


@given(user=st.text(st.characters(exclude_characters=":@", exclude_categories=["Cs"]),
                    max_size=8).filter(lambda u: not _ANOTHER_URL.search(u)),
       secret=st.text(st.characters(exclude_categories=["Cs"]), min_size=1)
       .filter(lambda p: not _ANOTHER_URL.search(p)),
       rest=st.sampled_from(["", "/0", ":6379/0?prefix=a", "/v?heartbeat=5#frag", ",h2:9092"]))
def test_any_password_is_hidden_in_route_labels_and_keys(user: str, secret: str,
                                                         rest: str) -> None:
    url = f"redis://{user}:{secret}@127.0.0.1{rest}"
    shown = f"redis://{user}:***@127.0.0.1{rest}"
    assert Route(url).label == shown
    assert route_key(url) == shown  # what the job table records


# --- refused where a broker client would misread it -----------------------------------

BROKERS = {
    "redis": "redis://default:{}@127.0.0.1:6379/0",
    "amqp": "amqp://guest:{}@127.0.0.1:5672/",
    "sqs": "sqs://AKIAEXAMPLE:{}@127.0.0.1:4566",
    "kafka": "kafka://user:{}@127.0.0.1:9092",
}


def make(given_as: str, given: Any) -> None:
    if given_as == "broker_url":
        duebox.Duebox("sqlite://", given).broker()
    else:
        duebox.Settings(broker_routes=given)


@pytest.mark.parametrize("scheme", sorted(BROKERS))
@pytest.mark.parametrize("c", ["/", "?", "#", "/?#@"])
@pytest.mark.parametrize("given_as", ["broker_url", "routes mapping", "routes text",
                                      "routes JSON"])
def test_a_broker_password_with_a_raw_slash_query_or_hash_is_refused_unprinted(
        scheme: str, c: str, given_as: str) -> None:
    """The redis:// one used to be accepted (redis-py then connected to host
    'default', port 'Zq7'); the others failed with the half of the password
    before the separator in the message ("Port could not be cast to integer
    value as 'Zq7'")."""
    url = BROKERS[scheme].format(password(c))
    field = "broker_url" if given_as == "broker_url" else "broker_routes"
    given: Any = {"broker_url": url, "routes mapping": {"q": url}, "routes text": f"q={url}",
                  "routes JSON": json.dumps({"q": url})}[given_as]
    with pytest.raises(ConfigurationError) as info:
        make(given_as, given)
    message = str(info.value)
    assert message.startswith(f"{field}: "), message
    assert "percent-encode" in message, message
    assert not leaked(message), message


@pytest.mark.parametrize("scheme", sorted(BROKERS))
def test_a_percent_encoded_or_raw_at_password_is_accepted_and_hidden(scheme: str) -> None:
    for secret in (password("%2F"), password("%3F%23"), password("@")):
        url = BROKERS[scheme].format(secret)
        settings = duebox.Settings(broker_routes={"q": url})
        app = duebox.Duebox("sqlite://", settings=settings)
        try:
            assert app.broker(queue="q").url == url
            shown = [r.label for r in app.routes.all()]
            assert not leaked(" ".join(shown)), shown
        finally:
            app.dispose()


def test_an_entry_that_is_not_queue_equals_url_is_shown_without_its_password() -> None:
    for text in (f"q redis://u:{password('/')}@h/0", f"=redis://u:{password('#')}@h/0",
                 f"a=redis://h/0,q;redis://u:{password('?')}@h/0"):
        with pytest.raises(ConfigurationError) as info:
            duebox.Settings(broker_routes=text)
        assert str(info.value).startswith("broker_routes: "), info.value
        assert not leaked(str(info.value)), info.value


def test_a_database_password_with_a_raw_at_is_refused_unprinted() -> None:
    """SQLAlchemy ends the password at its first '@' and takes the rest for
    the host, which every connection error then printed."""
    for url in (f"postgresql+psycopg://u:{password('@')}@127.0.0.1:1/db",
                f"postgresql+psycopg://u:{password('/@')}@127.0.0.1:1/db"):
        with pytest.raises(ConfigurationError) as info:
            _ = duebox.Duebox(url).engine
        assert str(info.value).startswith("database_url: "), info.value
        assert "%40" in str(info.value)
        assert not leaked(str(info.value)), info.value


def test_the_demo_line_hides_the_broker_password(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, [
        "demo", "--jobs", "2", "--spread", "0", "--cancels", "0",
        "--database-url", f"sqlite:///{tmp_path}/demo.db",
        "--broker-url", f"memory://user:{password('@')}@demo{uuid.uuid4().hex[:6]}"])
    assert result.exit_code == 0, result.output
    assert "with memory://user:***@demo" in result.output
    assert not leaked(result.output), result.output


# --- every output of the real processes ------------------------------------------------


@pytest.fixture
def database_with_password() -> Iterator[str]:
    """A migrated PostgreSQL database of its own, reached as a role whose
    password holds '/', '#' and '?' (which SQLAlchemy reads correctly)."""
    role = f"duebox_pw_{uuid.uuid4().hex[:8]}"
    with scratch_database("duebox_pw", [role]) as admin_url:
        admin = sa.make_url(admin_url)
        owner = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with owner.connect() as conn:
            conn.execute(sa.text(f"ALTER ROLE \"{role}\" PASSWORD '{password('/#?')}'"))
            conn.execute(sa.text(f'ALTER DATABASE "{admin.database}" OWNER TO "{role}"'))
        owner.dispose()
        url = (f"postgresql+psycopg://{role}:{password('/#?')}@{admin.host or '127.0.0.1'}"
               f":{admin.port or 5432}/{admin.database}")
        engine = sa.create_engine(url)
        migrate.upgrade(engine)
        engine.dispose()
        yield url


def routed_redis(keys: Keys) -> dict[str, str]:
    """Two routes to the tests' Redis whose passwords (any, for its default
    user) hold a raw '@' and a percent-encoded '/'."""
    base = REDIS.split("://", 1)[1]
    return {"emails": f"redis://default:{password('@')}@{base}?prefix={keys.prefix}e",
            "sms": f"redis://default:{password('%2F')}@{base}?prefix={keys.prefix}s"}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "duebox", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def start(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "duebox", *args], env=env, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)


def schedule(url: str, routes: dict[str, str]) -> list[uuid.UUID]:
    app = duebox.Duebox(url, settings=duebox.Settings(broker_routes=routes))
    app.task("routes.email", queue="emails")(lambda payload, ctx: None)
    app.task("routes.sms", queue="sms")(lambda payload, ctx: None)
    try:
        with Session(app.engine) as s, s.begin():
            return [app.schedule(s, task, {"n": n})
                    for n in range(2) for task in ("routes.email", "routes.sms")]
    finally:
        app.dispose()


def states(engine: sa.Engine, ids: list[uuid.UUID]) -> set[str]:
    with engine.connect() as conn:
        return {str(s) for s in conn.execute(
            sa.select(duebox.metadata.tables["duebox_job"].c.state)
            .where(duebox.metadata.tables["duebox_job"].c.id.in_(ids))).scalars()}


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_no_output_of_the_relay_worker_cli_or_dashboard_holds_a_password(
        database_with_password: str, redis_keys: Keys, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    url, routes = database_with_password, routed_redis(redis_keys)
    env = {**os.environ, "DUEBOX_DATABASE_URL": url, "DUEBOX_BROKER_ROUTES": json.dumps(routes),
           "DUEBOX_POLL_INTERVAL": "0.2", "DUEBOX_LOG_LEVEL": "DEBUG"}
    outputs: dict[str, str] = {}
    engine = sa.create_engine(url)
    procs = {"relay": start(env, tmp_path / "relay.log", "relay"),
             "worker": start(env, tmp_path / "worker.log", "worker", *APP, "--processes", "1")}
    try:
        ids = schedule(url, routes)

        def alive() -> None:
            for name, p in procs.items():
                assert p.poll() is None, (name, (tmp_path / f"{name}.log").read_text())

        poll("the routed jobs ran", lambda: states(engine, ids) == {"SUCCEEDED"}, 90,
             check=alive)
        # The read-only commands in this process (each a process of its own
        # would take seconds): their settings from the same environment.
        for command in (["routes"], ["routes", "--json"], ["status"], ["status", "--json"],
                        ["jobs", "list"], *(["jobs", "show", str(i)] for i in ids),
                        ["dlq", "list"], ["schedules", "list"]):
            result = CliRunner().invoke(cli, ["--log-level", "DEBUG", *command], env=env)
            outputs[" ".join(command)] = result.output
            assert result.exit_code in (0, 3, 4), (command, result.output, result.exception)
        assert "redis://default:***@" in outputs["routes"]
        assert "redis://default:***@" in outputs["status --json"]  # the relay's routes
        monkeypatch.setenv("DUEBOX_BROKER_ROUTES", json.dumps(routes))
        with dashboard_process(url, tmp_path) as dash:
            for page in ("/", "/processes", "/jobs", f"/jobs/{ids[0]}", f"/jobs/{ids[1]}",
                         "/dlq", "/schedules"):
                with urllib.request.urlopen(dash.url + page, timeout=30) as reply:
                    outputs[f"dashboard {page}"] = reply.read().decode()
        outputs["dashboard log"] = dash.log()
        outputs["the database"] = repr(snapshot(engine))  # published_to, registry rows
    finally:
        stop_processes(procs.values(), timeout=60)
        engine.dispose()
        for key in redis_keys.client.scan_iter(match=f"{redis_keys.prefix}*"):
            redis_keys.client.delete(key)
    for name, p in procs.items():
        outputs[f"{name} log"] = (tmp_path / f"{name}.log").read_text()
        assert p.returncode == 0, (name, outputs[f"{name} log"][-3000:])  # stopped by SIGTERM
    assert "started" in outputs["relay log"]
    assert "started" in outputs["worker log"]
    assert "redis://default:***@" in outputs["worker log"]
    for where, text in outputs.items():
        assert not leaked(text), (where, text[-3000:])


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_a_route_an_older_release_stored_with_its_password_is_shown_without_it(
        database_with_password: str, redis_keys: Keys) -> None:
    """``published_to`` of a job marked before this fix holds the password
    whole; ``duebox routes`` lists it as a leftover."""
    url, routes = database_with_password, routed_redis(redis_keys)
    job_id = schedule(url, routes)[0]
    engine = sa.create_engine(url)
    table = duebox.metadata.tables["duebox_job"]
    with engine.begin() as conn:
        conn.execute(table.update().where(table.c.id == job_id).values(
            state="ENQUEUED", published_to=f"redis://default:{password('/')}@old:6379/0"))
    engine.dispose()
    env = {**os.environ, "DUEBOX_DATABASE_URL": url, "DUEBOX_BROKER_ROUTES": json.dumps(routes)}
    for args in (["routes"], ["routes", "--json"]):
        result = CliRunner().invoke(cli, args, env=env)
        assert result.exit_code == 1, result.output  # a leftover is left
        assert "redis://default:***@old:6379/0" in result.output, result.output
        assert not leaked(result.output), result.output


@pytest.mark.parametrize("command", [["relay"], ["worker", *APP, "--processes", "1"],
                                     ["routes", *APP], ["status", *APP]])
@pytest.mark.parametrize("c", ["/", "#", "?"])
def test_a_command_given_an_unusable_password_says_so_in_one_line_without_it(
        tmp_path: Path, command: list[str], c: str) -> None:
    """The relay's start-up error printed it ("Port could not be cast to
    integer value as 'Zq7'"), `duebox routes` and `status` listed it."""
    env = {**os.environ, "DUEBOX_DATABASE_URL": f"sqlite:///{tmp_path}/d.db",
           "DUEBOX_BROKER_ROUTES": f"emails=redis://default:{password(c)}@127.0.0.1:6379/0"}
    done = run(env, *command)
    assert done.returncode == 1, done
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: ConfigurationError: broker_routes: "), lines
    assert not leaked(lines[0]), lines[0]

