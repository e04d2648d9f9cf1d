"""The framework recipes in examples/ run: each schedules through its
framework on the real PostgreSQL, in the same transaction as the order
(a refused order leaves no job), and the job then runs once.

- FastAPI: ``AsyncSession`` in the request; relay and worker in the lifespan
  (``duebox.Background``).
- Flask-SQLAlchemy: ``db.session``; relay and worker as ``python -m duebox``
  processes beside the app.
- Django: ``transaction.atomic()`` on Django's own connection
  (examples/django_shop/duebox_django); the app under ``manage.py runserver``,
  relay and worker as ``manage.py duebox ...`` processes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from backends import free_port
from sqlalchemy import create_engine, text

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DJANGO = EXAMPLES / "django_shop"


@pytest.fixture
def shop_db(pg_server_url: str) -> Iterator[str]:
    """A database of its own for one recipe (its tables, its jobs only)."""
    name = f"duebox_recipe_{uuid.uuid4().hex[:10]}"
    admin = create_engine(pg_server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield pg_server_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def env_for(url: str) -> dict[str, str]:
    return {**os.environ, "SHOP_DATABASE_URL": url, "PYTHONUNBUFFERED": "1"}


def run(args: list[str], cwd: Path, url: str) -> str:
    done = subprocess.run(args, cwd=cwd, env=env_for(url), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout


@contextlib.contextmanager
def processes(commands: list[list[str]], cwd: Path, url: str, logs: Path
              ) -> Iterator[Callable[[], None]]:
    """Start long-running commands; on exit SIGTERM them and require a clean
    stop.  Yields ``check()``, which fails at once if one has died."""
    procs = []
    for i, args in enumerate(commands):
        with (logs / f"proc{i}.log").open("w") as out:
            procs.append((args, subprocess.Popen(args, cwd=cwd, env=env_for(url), stdout=out,
                                                 stderr=subprocess.STDOUT),
                          logs / f"proc{i}.log"))

    def check() -> None:
        for args, proc, log in procs:
            assert proc.poll() is None, f"{args} died: {log.read_text()}"

    def stop() -> list[str]:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        unclean = []
        for args, proc, log in procs:
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            text_ = log.read_text()
            if "duebox" in args:  # the relay and the worker stop gracefully
                clean = code == 0
            elif "uvicorn" in args:  # re-raises the signal after a graceful shutdown
                clean = (code in (0, -signal.SIGTERM) and "Traceback" not in text_
                         and "Application shutdown complete" in text_)
            else:  # Django's development server simply dies
                clean = code in (0, -signal.SIGTERM)
            if not clean:
                unclean.append(f"{args} exited {code}: {text_}")
        return unclean

    try:
        yield check
    except BaseException:
        stop()
        raise
    unclean = stop()
    assert not unclean, unclean


def wait_until(predicate: Callable[[], Any], what: str, check: Callable[[], None] = lambda: None,
               timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        check()
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def rows(url: str, sql: str) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql)).all())
    finally:
        engine.dispose()


def execute(url: str, sql: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(sql))
    finally:
        engine.dispose()


def registered(url: str) -> bool:
    """A relay and a worker have written their first heartbeat (so they are
    past start-up, and a SIGTERM now is a graceful stop)."""
    names = [n for (n,) in rows(url, "SELECT name FROM duebox_lease")]
    return all(any(n.startswith(f"{role}:") for n in names) for role in ("relay", "worker"))


def check_one_order_one_job_ran_once(url: str, table: str, order_id: int, job_id: str) -> None:
    assert rows(url, f"SELECT id, confirmations FROM {table}") == [(order_id, 1)]
    jobs = rows(url, "SELECT id, state, key, attempt FROM duebox_job")
    assert [(str(j), s, k, a) for j, s, k, a in jobs] == [
        (job_id, "SUCCEEDED", f"confirm-order:{order_id}", 1)]


def fresh_import(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for loaded in [m for m in sys.modules if m.split(".")[0] == name.split(".")[0]]:
        monkeypatch.delitem(sys.modules, loaded)
    return importlib.import_module(name)


def test_fastapi_recipe_schedules_in_the_request_and_runs_in_the_lifespan(
        shop_db: str, tmp_path: Path) -> None:
    run([sys.executable, "-m", "duebox", "db", "upgrade", "--app", "fastapi_shop.main:jobs"],
        EXAMPLES, shop_db)
    port = free_port()
    uvicorn = [sys.executable, "-m", "uvicorn", "fastapi_shop.main:api", "--port", str(port)]
    # uvicorn runs the lifespan: the shop's tables, then relay + worker
    # (duebox.Background); SIGTERM must stop them cleanly (exit 0).
    with processes([uvicorn], EXAMPLES, shop_db, tmp_path) as check, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
        wait_until(lambda: answers(http), "uvicorn to answer", check)
        wait_until(lambda: registered(shop_db), "the lifespan's relay and worker", check)
        # Before a stock row exists: refused as documented (examples/README.md),
        # not a 500 from the order's foreign key.
        early = http.post("/orders", json={"item": "tea", "quantity": 1})
        assert early.status_code == 409, early.text
        execute(shop_db, "INSERT INTO fastapi_shop_stock VALUES ('tea', 3)")
        placed = http.post("/orders", json={"item": "tea", "quantity": 2, "confirm_after": 0.5})
        assert placed.status_code == 201, placed.text
        refused = http.post("/orders", json={"item": "tea", "quantity": 2})
        assert refused.status_code == 409, refused.text
        order_id = placed.json()["order_id"]
        wait_until(lambda: http.get(f"/orders/{order_id}").json()["confirmations"] == 1,
                   "the confirmation job to run in the lifespan's worker", check)
    # The refused order and its job were rolled back together.
    check_one_order_one_job_ran_once(shop_db, "fastapi_shop_order", order_id,
                                     placed.json()["job_id"])


def answers(http: httpx.Client) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return http.get("/orders/0").status_code == 404
    return False


def test_flask_recipe_schedules_in_db_session_and_runs_beside_it(
        shop_db: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    app_spec = "flask_shop.main:jobs"
    run([sys.executable, "-m", "duebox", "db", "upgrade", "--app", app_spec], EXAMPLES, shop_db)
    monkeypatch.setenv("SHOP_DATABASE_URL", shop_db)
    shop = fresh_import("flask_shop.main", monkeypatch)
    app = shop.create_app()
    try:
        client = app.test_client()
        # Before a stock row exists: refused, not a 500 from the foreign key.
        assert client.post("/orders", json={"item": "tea", "quantity": 1}).status_code == 409
        with app.app_context():
            shop.db.session.execute(text("INSERT INTO flask_shop_stock VALUES ('tea', 3)"))
            shop.db.session.commit()
        placed = client.post("/orders", json={"item": "tea", "quantity": 2})
        assert placed.status_code == 201, placed.text
        assert client.post("/orders", json={"item": "tea", "quantity": 2}).status_code == 409
        order_id = placed.get_json()["order_id"]
        assert rows(shop_db, "SELECT state FROM duebox_job") == [("SCHEDULED",)]
        with processes([[sys.executable, "-m", "duebox", "relay", "--app", app_spec],
                        [sys.executable, "-m", "duebox", "worker", "--app", app_spec]],
                       EXAMPLES, shop_db, tmp_path) as check:
            wait_until(lambda: registered(shop_db), "the relay and the worker to start", check)
            wait_until(lambda: client.get(f"/orders/{order_id}").get_json()["confirmations"] == 1,
                       "the confirmation job to run in the worker process", check)
    finally:  # the app's and duebox's connections, also when the test fails
        with app.app_context():
            shop.db.engine.dispose()
        shop.jobs.dispose()
    check_one_order_one_job_ran_once(shop_db, "flask_shop_order", order_id,
                                     placed.get_json()["job_id"])


def test_django_recipe_schedules_in_atomic_on_djangos_connection(
        shop_db: str, tmp_path: Path) -> None:
    manage = [sys.executable, "manage.py"]
    run([*manage, "migrate"], DJANGO, shop_db)
    run([*manage, "duebox", "db", "upgrade"], DJANGO, shop_db)
    outside = run([*manage, "shell", "-c",
                   "import duebox_django\n"
                   "try:\n with duebox_django.connection(): pass\n"
                   "except RuntimeError as exc: print(exc)"], DJANGO, shop_db)
    assert "inside transaction.atomic()" in outside
    execute(shop_db, "INSERT INTO orders_stock VALUES ('tea', 3)")
    port = free_port()
    web = f"http://127.0.0.1:{port}"
    with processes([[*manage, "runserver", "--noreload", f"127.0.0.1:{port}"],
                    [*manage, "duebox", "relay"], [*manage, "duebox", "worker"]],
                   DJANGO, shop_db, tmp_path) as check, httpx.Client(base_url=web) as http:
        wait_until(lambda: answers(http), "runserver to answer", check)
        wait_until(lambda: registered(shop_db), "the relay and the worker to start", check)
        placed = http.post("/orders", json={"item": "tea", "quantity": 2, "confirm_after": 0.5})
        assert placed.status_code == 201, placed.text
        refused = http.post("/orders", json={"item": "tea", "quantity": 2})
        assert refused.status_code == 409, refused.text
        order_id = placed.json()["order_id"]
        wait_until(lambda: http.get(f"/orders/{order_id}").json()["confirmations"] == 1,
                   "the confirmation job to run in `manage.py duebox worker`", check)
    check_one_order_one_job_ran_once(shop_db, "orders_order", order_id, placed.json()["job_id"])
