"""Connection trouble, said once (issue #33 item 7), through the real
``duebox relay`` and ``duebox worker`` commands on the real services:

* a RabbitMQ that refuses the login or the vhost, or a PostgreSQL that has
  no such role, ends the process after a short grace with one line and exit
  status 78 (EX_CONFIG).  They used to print pika's 5-6 ERROR lines and
  retry forever;
* a 12 s PostgreSQL cut while jobs fall due is one line per process, in
  duebox's words.  It used to be about 30 WARNING lines from 5 loggers,
  several of 3 lines with psycopg's text and a sqlalche.me link.

The database is reached through a TCP proxy of the test's own
(tests/soak/proxy.py) for the cut: the shared server is never stopped.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import sqlalchemy as sa
from backends import AMQP, poll, stop_processes, with_params
from conftest import reset_tables
from sqlalchemy.orm import Session
from test_database_at_start import Started
from test_hostile_processes import through

import duebox
from tests.soak.proxy import Proxy

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

APP = ["--app", "tests.apps.routes_app:app"]
EX_CONFIG = 78
# How long a refused process may take to give up: the grace (5 s) plus its
# start-up on a loaded machine; on main it never gave up.
GIVES_UP_WITHIN = 90.0
TIMESTAMPED = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@pytest.fixture
def database_url(pg_server_url: str) -> str:
    reset_tables(pg_server_url)
    return pg_server_url


@pytest.fixture
def started(tmp_path: Path, database_url: str) -> Iterator[Started]:
    s = Started(tmp_path, {**os.environ, "DUEBOX_DATABASE_URL": database_url,
                           "DUEBOX_POLL_INTERVAL": "0.2"})
    try:
        yield s
    finally:
        stop_processes(s.procs.values(), timeout=30)


def amqp_with(*, password: str | None = None, vhost: str | None = None) -> str:
    parts = urlsplit(AMQP)
    netloc = parts.netloc
    if password is not None:
        netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port or 5672}"
    return urlunsplit(parts._replace(netloc=netloc, path=f"/{vhost}" if vhost else parts.path))


def ended(started: Started, name: str) -> tuple[int, list[str]]:
    """Its exit status once it ended by itself, and its output's lines."""
    poll(f"{name} to give up", lambda: started.procs[name].poll() is not None,
         GIVES_UP_WITHIN)
    return started.procs[name].returncode, started.log(name).strip().splitlines()


def test_a_refused_login_or_vhost_ends_relay_and_workers_with_one_line_and_78(
        started: Started) -> None:
    wrong_password = amqp_with(password="not-the-password")
    no_vhost = amqp_with(vhost=f"duebox_absent_{uuid.uuid4().hex[:8]}")
    started.start("relay", "relay", "--broker-url", wrong_password)
    started.start("worker", "worker", *APP, "--processes", "1", "--broker-url", no_vhost)
    started.start("supervisor", "worker", *APP, "--processes", "2",
                  "--broker-url", wrong_password)
    for name, says in (("relay", "403 ACCESS_REFUSED"), ("worker", "530 NOT_ALLOWED"),
                       ("supervisor", "403 ACCESS_REFUSED")):
        code, lines = ended(started, name)
        assert code == EX_CONFIG, lines
        assert len(lines) == 1, lines  # not pika's five or six ERROR lines first
        [line] = lines
        assert line.startswith("Error: AccessRefusedError: RabbitMQ at "), line
        assert says in line, line
        assert "user, password and vhost" in line, line  # what to do


def test_a_database_without_the_role_ends_the_relay_with_one_line_and_78(
        started: Started, database_url: str) -> None:
    nobody = sa.make_url(database_url).set(username=f"duebox_absent_{uuid.uuid4().hex[:8]}")
    started.env["DUEBOX_DATABASE_URL"] = nobody.render_as_string(hide_password=False)
    started.start("relay", "relay")
    code, lines = ended(started, "relay")
    assert code == EX_CONFIG, lines
    assert len(lines) == 1, lines
    assert "the database refused the connection: role " in lines[0], lines
    assert "does not exist" in lines[0], lines


@pytest.fixture
def proxy(database_url: str) -> Iterator[Proxy]:
    parts = urlsplit(database_url)
    p = Proxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    p.start()
    try:
        yield p
    finally:
        p.close()


def test_a_database_cut_is_one_line_per_process_whatever_meets_it(
        started: Started, proxy: Proxy, database_url: str, amqp_vhost: str) -> None:
    """A 12 s cut while 200 jobs fall due: the relay's passes, LISTEN,
    heartbeat and liveness lock, the worker's deliveries and batch lane all
    meet it; each process says so once, then every job runs."""
    started.env.update(DUEBOX_DATABASE_URL=through(proxy, database_url),
                       DUEBOX_BROKER_URL=with_params(amqp_vhost,
                                                     prefix=f"cut{uuid.uuid4().hex[:8]}"))
    started.start("relay", "relay")
    started.start("worker", "worker", *APP, "--processes", "1")
    app = duebox.Duebox(database_url, started.env["DUEBOX_BROKER_URL"])
    app.task("routes.email", queue="emails")(lambda payload, ctx: None)
    job = duebox.metadata.tables["duebox_job"]

    def succeeded(ids: list[uuid.UUID]) -> bool:
        with app.engine.connect() as conn:
            done = conn.execute(sa.select(sa.func.count()).where(
                job.c.id.in_(ids), job.c.state == "SUCCEEDED")).scalar_one()
        return bool(done == len(ids))

    try:
        with Session(app.engine) as s, s.begin():
            first = [app.schedule(s, "routes.email", {"n": -1})]
        poll("a first job to run", lambda: succeeded(first), 90, check=started.alive)
        before = {n: len(started.log(n).splitlines()) for n in ("relay", "worker")}
        with Session(app.engine) as s, s.begin():
            ids = app.schedule_many(s, [app.new_job("routes.email", {"n": i}, delay=1.5)
                                        for i in range(200)])
        time.sleep(1.0)  # published with their delay by now: due during the cut
        proxy.set_mode("cut")
        try:
            time.sleep(12.0)  # the outage itself: nothing to wait for but time
            started.alive()
        finally:
            proxy.set_mode("pass")
        poll("every job after the cut", lambda: succeeded(ids), 180, check=started.alive)
    finally:
        app.dispose()
    for name in ("relay", "worker"):
        assert started.stop(name) == 0, started.log(name)
        log = started.log(name)
        lines = log.splitlines()[before[name]:]
        assert all(TIMESTAMPED.match(line) for line in lines), log  # one line each
        said = "\n".join(lines)  # since the jobs were scheduled: duebox's words only
        for drivers in ("sqlalche.me", "psycopg", "OperationalError"):
            assert drivers not in said, log
        warned = [line for line in lines if re.search(r" (WARNING|ERROR|CRITICAL) ", line)]
        assert warned, log
        assert all("database unreachable" in line for line in warned), log
        # One line for the cause; a count of its repeats may follow, later.
        assert len([line for line in warned if " like this in " not in line]) == 1, log
