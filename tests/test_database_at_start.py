"""A relay or worker started while its database cannot be reached waits for
it, saying so once per interval, and starts when it answers; it exits only
on a stop signal or a configuration error (docs/hostile-input.md,
"Processes").  They used to exit 1 at once, though the same processes
already running ride out an outage.

The database is PostgreSQL behind a TCP proxy of the test's own (the
soak's, tests/soak/proxy.py) that refuses every connection at first and
then passes them: the shared server is never stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from backends import ROOT, Keys, poll, stop_processes
from conftest import reset_tables
from sqlalchemy.orm import Session
from test_hostile_processes import through

import duebox
from tests.soak.proxy import Proxy

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(240)]

APP = ["--app", "tests.apps.routes_app:app"]
WAITING = "waiting for it"


@pytest.fixture
def database_url(pg_server_url: str) -> str:
    reset_tables(pg_server_url)
    return pg_server_url


@pytest.fixture
def proxy(database_url: str) -> Iterator[Proxy]:
    """A TCP proxy in front of the test's PostgreSQL, refusing connections."""
    parts = urlsplit(database_url)
    p = Proxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    p.start()
    p.set_mode("cut")
    try:
        yield p
    finally:
        p.close()


class Started:
    """``duebox`` commands as processes, each logging to a file of its own."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        with (self.tmp / f"{name}.log").open("wb") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "duebox", *args], env=self.env, cwd=ROOT,
                stdout=out, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def alive(self) -> None:
        for name, p in self.procs.items():
            assert p.poll() is None, f"{name} exited {p.returncode}:\n{self.log(name)}"

    def stop(self, name: str) -> int:
        """SIGTERM, as a deploy stops it: its exit status."""
        p = self.procs[name]
        p.send_signal(signal.SIGTERM)
        return p.wait(60)


@pytest.fixture
def started(tmp_path: Path, database_url: str, proxy: Proxy,
            redis_keys: Keys) -> Iterator[Started]:
    env = {**os.environ, "DUEBOX_DATABASE_URL": through(proxy, database_url),
           "DUEBOX_BROKER_URL": redis_keys.url(), "DUEBOX_POLL_INTERVAL": "0.2"}
    s = Started(tmp_path, env)
    try:
        yield s
    finally:
        stop_processes(s.procs.values(), timeout=30)


def test_a_relay_and_worker_started_before_the_database_wait_for_it_then_run(
        started: Started, proxy: Proxy, database_url: str, redis_keys: Keys) -> None:
    started.start("relay", "relay")
    started.start("worker", "worker", *APP, "--processes", "1")
    for name in ("relay", "worker"):
        poll(f"{name} says it waits", lambda n=name: WAITING in started.log(n), 60,
             check=started.alive)
    # Both ask again every second meanwhile, and say so once: not a storm.
    asked = proxy.accepted()
    poll("several more attempts", lambda: proxy.accepted() >= asked + 8, 60,
         check=started.alive)
    for name in ("relay", "worker"):
        log = started.log(name)
        assert log.count(WAITING) == 1, log
        assert "Traceback" not in log, log
        assert len(log.strip().splitlines()) == 1, log
    proxy.set_mode("pass")
    app = duebox.Duebox(database_url, redis_keys.url())
    app.task("routes.email", queue="emails")(lambda payload, ctx: None)
    try:
        with Session(app.engine) as s, s.begin():
            job_id = app.schedule(s, "routes.email", {"n": 1})
        job = duebox.metadata.tables["duebox_job"]

        def ran() -> bool:
            with app.engine.connect() as conn:
                state = conn.execute(sa.select(job.c.state).where(job.c.id == job_id)).scalar()
            return str(state) == "SUCCEEDED"

        poll("the job ran once the database answered", ran, 90, check=started.alive)
    finally:
        app.dispose()
    for name in ("relay", "worker"):
        assert "the database answers; starting" in started.log(name), started.log(name)
        assert started.stop(name) == 0, started.log(name)


@pytest.mark.parametrize("command", [["relay"], ["worker", *APP, "--processes", "1"],
                                     ["worker", *APP, "--processes", "2"]],
                         ids=["relay", "worker", "supervisor"])
def test_a_process_waiting_for_its_database_stops_on_sigterm(
        started: Started, command: list[str]) -> None:
    started.start("waiting", *command)
    poll("it says it waits", lambda: WAITING in started.log("waiting"), 60,
         check=started.alive)
    assert started.stop("waiting") == 0, started.log("waiting")


def test_a_database_without_the_tables_still_ends_a_relay_at_once(
        started: Started, proxy: Proxy, pg_server_url: str) -> None:
    """Waiting would not mend it: one line saying what to do, exit 1."""
    proxy.set_mode("pass")
    bare = f"duebox_bare_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{bare}"'))
    try:
        started.env["DUEBOX_DATABASE_URL"] = through(
            proxy, sa.make_url(pg_server_url).set(database=bare)
            .render_as_string(hide_password=False))
        started.start("relay", "relay")
        assert started.procs["relay"].wait(60) == 1, started.log("relay")
        assert "run `duebox db upgrade`" in started.log("relay"), started.log("relay")
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{bare}" WITH (FORCE)'))
        admin.dispose()
