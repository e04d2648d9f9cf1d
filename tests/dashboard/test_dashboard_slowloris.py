"""Slow and many clients: half-open connections cost no thread and are
closed by deadline, a full server makes room by closing the connection that
has waited longest for a head, and views run on a bounded pool (503 beyond).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from conftest import reset_tables

import duebox
from duebox.dashboard.server import Limits

from .conftest import Client
from .seed import Seeded
from .wire import closed_within, connect

Serve = Callable[..., Client]
HALF_HEAD = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@contextmanager
def half_open(url: str, n: int) -> Iterator[list[socket.socket]]:
    socks = []
    try:
        for _ in range(n):
            sock = connect(url)
            sock.sendall(HALF_HEAD)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _status(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After") or ""


def test_half_open_connections_hold_no_thread_and_are_closed_by_deadline(
        sqlite_seeded: Seeded, serve: Serve) -> None:
    """The old server held a thread for each of 600 half-open connections,
    and held them all 30 s later."""
    before = threading.active_count()
    limits = Limits(head_timeout=3.0, threads=4)
    c = serve(sqlite_seeded.app, limits=limits)
    with half_open(c.base, 600) as socks:
        start = time.monotonic()
        page = c.get("/jobs")  # a legitimate client meanwhile
        assert page.status == 200
        assert time.monotonic() - start < 5
        assert threading.active_count() - before <= limits.threads + 1
        left = start + limits.head_timeout + 10 - time.monotonic()
        assert len(closed_within(socks, left)) == len(socks)
    assert c.get("/processes").status == 200


def test_a_full_server_closes_the_longest_waiting_connection(sqlite_seeded: Seeded,
                                                             serve: Serve) -> None:
    limits = Limits(head_timeout=60.0, max_connections=50)
    c = serve(sqlite_seeded.app, limits=limits)
    with half_open(c.base, 50) as first, half_open(c.base, 50) as second:
        # Room was made for the second fifty by closing the first fifty...
        assert len(closed_within(first, 5)) == len(first)
        # ... and for this request by closing one of the second.
        assert c.get("/processes").status == 200
        assert len(closed_within(second, 1)) == 1


def _wait_for_lock_waiters(url: str, n: int) -> None:
    """Until ``n`` sessions wait for a lock on the job table."""
    engine = sa.create_engine(url)
    deadline = time.monotonic() + 30
    try:
        with engine.connect() as conn:
            while conn.execute(sa.text(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted "
                    "AND relation = 'duebox_job'::regclass")).scalar_one() < n:
                assert time.monotonic() < deadline, "the views never reached the table"
                conn.rollback()
                time.sleep(0.02)
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_views_run_on_a_bounded_pool_and_requests_beyond_it_get_503(
        pg_server_url: str, serve: Serve) -> None:
    """With every view thread stuck on a locked table, further requests wait
    ``queue_wait`` and are answered 503 with Retry-After; once the lock goes,
    the stuck ones finish and the dashboard serves again."""
    reset_tables(pg_server_url)
    app = duebox.Duebox(pg_server_url)
    limits = Limits(threads=2, queue_wait=1.0)
    c = serve(app, limits=limits)
    before = threading.active_count()
    locker = app.engine.connect()
    try:
        locker.execute(sa.text("LOCK TABLE duebox_job IN ACCESS EXCLUSIVE MODE"))
        with ThreadPoolExecutor(5) as pool:
            stuck = [pool.submit(_status, c.base + "/jobs", 60) for _ in range(2)]
            _wait_for_lock_waiters(pg_server_url, 2)
            refused = [pool.submit(_status, c.base + "/jobs", 30) for _ in range(3)]
            assert [f.result() for f in refused] == [(503, "1")] * 3
            assert not any(f.done() for f in stuck)
            assert threading.active_count() - before <= limits.threads + 5
            locker.rollback()
            assert [f.result()[0] for f in stuck] == [200, 200]
        assert _status(c.base + "/jobs")[0] == 200
    finally:
        locker.close()
        c.server.stop()  # type: ignore[union-attr]
        app.dispose()
