"""compose.yaml's deployment, run here without Docker: each service's own
command (`duebox db upgrade`, `relay`, `worker`, `dashboard`) as a process
on this machine's PostgreSQL and Redis, in the folder compose.yaml mounts
as the app, each judged ready by its own health check; then a job
scheduled through the default app runs, and the dashboard's JSON API shows
it.  Only the addresses change: the services' host names become
127.0.0.1, and fixed ports free ones (other tests share this machine)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import Keys, free_port
from conftest import pg_database
from test_compose import ROOT, command_of, services, with_defaults

import duebox

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def empty_pg() -> Iterator[str]:
    """A PostgreSQL database of this test's own, without duebox's tables
    (the migrate service creates them)."""
    with pg_database("duebox_compose") as url:
        yield url


def _on_free_ports(args: list[str], check: list[str]) -> tuple[list[str], list[str]]:
    """``args`` and its health check with each port option's value moved
    to a free port."""
    args, check = list(args), list(check)
    for i, arg in enumerate(args):
        if arg in ("--port", "--metrics-port"):
            port = str(free_port())
            check = [part.replace(f":{args[i + 1]}/", f":{port}/") for part in check]
            args[i + 1] = port
    return args, check


def _healthy(check: list[str], env: dict[str, str]) -> bool:
    assert check[:2] == ["CMD", "python"], check
    return subprocess.run([sys.executable, *check[2:]], env=env, capture_output=True,
                          timeout=30).returncode == 0


def _wait(predicate: Callable[[], Any], what: str, alive: Callable[[], None],
          timeout: float = 90.0) -> None:
    """Poll ``predicate``: the processes give no event to wait on."""
    deadline = time.monotonic() + timeout
    while not predicate():
        alive()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_the_deployment_starts_and_runs_a_job(empty_pg: str, redis_keys: Keys,
                                              tmp_path: Path) -> None:
    found = services()
    service = found["relay"]
    app_dir = ROOT / with_defaults(service["volumes"][0]).split(":")[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUEBOX_")}
    env.update({k: with_defaults(v) for k, v in service["environment"].items() if v is not None})
    assert env["DUEBOX_DATABASE_URL"].startswith("postgresql+psycopg://duebox:duebox@postgres:")
    assert env["DUEBOX_BROKER_URL"].startswith("redis://redis:6379/")
    env["DUEBOX_DATABASE_URL"] = empty_pg
    env["DUEBOX_BROKER_URL"] = redis_keys.url()

    def run(args: list[str]) -> list[str]:
        command_of(args)  # the CLI's own command (tests/test_compose.py)
        return [sys.executable, "-m", "duebox", *args]

    migrate = subprocess.run(run(found["migrate"]["command"]), cwd=app_dir, env=env,
                             capture_output=True, text=True, timeout=120)
    assert migrate.returncode == 0, migrate.stderr

    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    checks: dict[str, list[str]] = {}
    with contextlib.ExitStack() as stack:
        for name in ("relay", "worker", "dashboard"):
            args, checks[name] = _on_free_ports(found[name]["command"],
                                                found[name]["healthcheck"]["test"])
            log = tmp_path / f"{name}.log"
            out = stack.enter_context(log.open("wb"))
            procs[name] = (subprocess.Popen(run(args), cwd=app_dir, env=env, stdout=out,
                                            stderr=subprocess.STDOUT), log)
            stack.callback(_stop, name, *procs[name])

        def alive() -> None:
            for name, (proc, log) in procs.items():
                assert proc.poll() is None, f"{name} exited: {log.read_text()[-3000:]}"

        for name, check in checks.items():
            _wait(lambda check=check: _healthy(check, env), f"{name}'s health check", alive)

        # A producer of its own: the same task name, its handler is the worker's.
        jobs = duebox.Duebox(database_url=empty_pg, broker_url=redis_keys.url())
        jobs.add_task("send-reminder", lambda payload, ctx: None)
        try:
            job_id = jobs.enqueue("send-reminder", {"order_id": 42})
            _wait(lambda: _state(jobs, job_id) == "SUCCEEDED", "the job to run", alive)
        finally:
            jobs.dispose()
        dashboard = next(part for part in checks["dashboard"] if "/healthz" in part)
        base = dashboard.split("'")[1].removesuffix("/healthz")
        with urllib.request.urlopen(f"{base}/api/jobs/{job_id}", timeout=10) as r:
            shown = json.loads(r.read())
        assert (shown["task"], shown["state"]) == ("send-reminder", "SUCCEEDED")
        assert "reminder for order 42" in procs["worker"][1].read_text()


def _state(app: duebox.Duebox, job_id: uuid.UUID) -> str:
    with app.engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT state FROM duebox_job WHERE id = :id"),
                                {"id": job_id}).scalar_one())


def _stop(name: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """As ``docker compose stop`` does: SIGTERM.  The relay and the worker
    stop cleanly (0); the dashboard, a read-only server, may simply end."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{name} did not stop on SIGTERM: {log.read_text()[-3000:]}"
                             ) from None
    allowed = (0, -signal.SIGTERM) if name == "dashboard" else (0,)
    assert code in allowed, f"{name} exited {code}: {log.read_text()[-3000:]}"
