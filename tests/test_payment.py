"""A charge survives a worker killed between the charge and the completion:
the retry reuses the idempotency key and the provider charges nothing new."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import pytest
import sqlalchemy as sa
from helpers import Running, attempt_rows, job_row, make_app, schedule_committed

import duebox
from duebox.tables import audit

ROOT = Path(__file__).resolve().parent.parent


class Provider:
    """A payment provider that honours ``Idempotency-Key``."""

    def __init__(self) -> None:
        self.charges: dict[str, dict[str, Any]] = {}
        self.requests: list[str] = []
        self.lock = threading.Lock()
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                key = self.headers.get("Idempotency-Key", "")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with provider.lock:
                    provider.requests.append(key)
                    charge = provider.charges.get(key)
                    status = 200
                    if charge is None:
                        charge = {"id": f"ch_{uuid.uuid4().hex[:8]}", "amount": body["amount"]}
                        provider.charges[key] = charge
                        status = 201
                data = json.dumps(charge).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Provider:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def provider() -> Iterator[Provider]:
    with Provider() as p:
        yield p


def _worker(database_url: str, provider: Provider, log: IO[bytes]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DUEBOX_DATABASE_URL": database_url, "DUEBOX_LEASE_SECONDS": "1",
           "DUEBOX_CLOCK_SKEW_MARGIN": "0.1", "DUEBOX_POLL_INTERVAL": "0.05",
           "PAYMENT_URL": provider.url, "DUEBOX_LOG_LEVEL": "WARNING"}
    # One process: the test kills *the* worker right after the charge (with
    # a supervisor the kill would reach the children only through their
    # parent-death signal, which tests/test_worker_processes.py tests).
    return subprocess.Popen(
        [sys.executable, "-m", "duebox.cli", "worker", "--app", "tests.apps.payment_app:app",
         "--processes", "1"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
    )


@pytest.mark.slow
async def test_worker_killed_after_charge_charges_exactly_once(
    database_url: str, provider: Provider, tmp_path: Path
) -> None:
    app = make_app(database_url, lease_seconds=1.0, clock_skew_margin=0.1)

    @app.task("pay", max_attempts=3)
    def pay(payload: Any, ctx: duebox.JobContext) -> None:  # pragma: no cover - producer side
        raise AssertionError("runs in the worker process")

    job_id = schedule_committed(app, "pay", {"amount": 1999}, key="invoice-2026-001")
    log_path = tmp_path / "workers.log"
    log = log_path.open("ab")
    first = _worker(database_url, provider, log)
    second = None
    try:
        # a relay in this process recovers the killed worker's expired lease
        async with Running(app, workers=0) as r:
            await r.wait(lambda: len(provider.requests) == 1, timeout=30,
                         what="the first attempt to charge")
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
            second = _worker(database_url, provider, log)
            await r.wait(lambda: job_row(app.engine, job_id).state == "SUCCEEDED", timeout=30,
                         what="the retry to complete the job")
    finally:
        for proc in (first, second):
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=15)
        log.close()
        print(log_path.read_text())
    attempts = attempt_rows(app.engine, job_id)
    with app.engine.connect() as conn:
        recorded = conn.execute(sa.select(audit.c.reason).where(audit.c.action == "charged")
                                ).scalars().all()
    app.dispose()
    assert provider.requests == ["invoice-2026-001", "invoice-2026-001"]
    assert len(provider.charges) == 1
    (charge,) = provider.charges.values()
    assert recorded == [charge["id"]]
    assert [(a.number, a.outcome) for a in attempts] == [(1, "lost"), (2, "succeeded")]
