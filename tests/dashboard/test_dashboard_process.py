"""The hostile-client findings against a real ``duebox dashboard`` process,
on SQLite and PostgreSQL: what only a process shows (its threads, its peak
memory, its log) with the default limits a user gets."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlencode

import pytest
import sqlalchemy as sa
from conftest import pg_database, reset_tables

from duebox.dashboard.server import Limits

from .conftest import TOKEN
from .procs import Process, dashboard_process
from .seed import Seeded
from .wire import closed_within, connect, get, post, read_reply, request

MiB = 1024 * 1024
DEFAULT = Limits()


def _clean(p: Process) -> None:
    log = p.log()
    assert " ERROR " not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def _get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After") or ""


def test_600_half_open_connections(seeded: Seeded, tmp_path: Path) -> None:
    """The old process held 600 threads for 600 half-open connections, and
    still did 30 s later."""
    with dashboard_process(seeded.app.settings.database_url, tmp_path) as p:
        assert _get(p.url + "/")[0] == 200
        socks: list[socket.socket] = []
        try:
            for _ in range(600):
                sock = connect(p.url)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                socks.append(sock)
            start = time.monotonic()
            assert _get(p.url + "/jobs?state=DEAD")[0] == 200  # a real client meanwhile
            served_in = time.monotonic() - start
            threads = p.threads()
            assert threads <= DEFAULT.threads + 3, threads
            left = DEFAULT.head_timeout + 10 - (time.monotonic() - start)
            assert len(closed_within(socks, left)) == 600
        finally:
            for sock in socks:
                sock.close()
        print(f"600 half-open: a request served in {served_in:.3f} s, {threads} threads")
        _clean(p)


def test_a_body_without_a_usable_length_is_never_read(seeded: Seeded, tmp_path: Path) -> None:
    """``Content-Length: -1`` and 64 MiB: the old process read it all before
    refusing the request (403), its peak memory up by 64-133 MB."""
    with dashboard_process(seeded.app.settings.database_url, tmp_path, token=TOKEN) as p:
        assert _get(p.url + "/dlq")[0] == 200
        before = p.peak_rss_kib()
        for length, status in (("-1", 400), (str(64 * MiB), 413), ("abc", 400)):
            with connect(p.url, timeout=60) as sock:
                sock.sendall(f"POST /dlq/purge HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             f"Content-Length: {length}\r\n\r\n".encode())

                def flood(sock: socket.socket = sock) -> None:
                    chunk = b"x" * MiB
                    try:
                        for _ in range(64):
                            sock.sendall(chunk)
                        sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass  # refused and closed: what should happen

                sender = threading.Thread(target=flood)
                sender.start()
                reply = read_reply(sock, 60)
                sender.join(60)
                assert reply.status == status, (length, reply)
        grown = p.peak_rss_kib() - before
        print(f"three 64 MiB floods: peak memory grew {grown} KiB")
        assert grown < 16 * 1024
        _clean(p)


def test_a_thousand_wrong_tokens(seeded: Seeded, tmp_path: Path) -> None:
    with dashboard_process(seeded.app.settings.database_url, tmp_path, token=TOKEN) as p:
        page = urllib.request.urlopen(p.url + "/dlq", timeout=10)
        cookie = page.headers["Set-Cookie"].split(";")[0]
        m = re.search(r'name=csrf value="([0-9a-f.]+)"', page.read().decode())
        assert m
        host = p.url.removeprefix("http://")
        statuses: Counter[int | None] = Counter()
        start = time.monotonic()
        for i in range(1000):
            form = urlencode({"csrf": m.group(1), "token": f"guess-{i}", "operator": "eve",
                              "reason": "x", "error_class": "transient"}).encode()
            statuses[request(p.url, post("/dlq/purge", form, host=host,
                                         extra=f"Cookie: {cookie}\r\n")).status] += 1
        took = time.monotonic() - start
        print(f"1,000 wrong tokens: {dict(statuses)} in {took:.2f} s")
        assert statuses[429] >= 980, statuses
        assert statuses[403] <= 20, statuses
        assert p.log().count("failed to authenticate") == 1
        _clean(p)


def test_hostile_queries_are_400_and_log_nothing(seeded: Seeded, tmp_path: Path) -> None:
    with dashboard_process(seeded.app.settings.database_url, tmp_path) as p:
        for path in ("/jobs?q=%00", "/jobs?queue=a%00b", "/dlq?task=%00", "/schedules/a%00b",
                     "/schedules?after=%00", "/jobs?q=%ff", "/jobs?from=0001-01-01T00:00%2B01:00",
                     "/jobs?queue=%1b%5b2J", "/jobs?q=" + "x" * 5000):
            assert request(p.url, get(path)).status == 400, path
        assert request(p.url, get("/jobs?q=" + "x" * 20000)).status == 431
        _clean(p)


@pytest.mark.parametrize("host", ["::1", "127.0.0.2"])
def test_other_loopback_addresses(seeded: Seeded, tmp_path: Path, host: str) -> None:
    """``--host ::1`` could not bind; ``--host 127.0.0.2`` answered any Host."""
    with dashboard_process(seeded.app.settings.database_url, tmp_path, "--host", host) as p:
        netloc = p.url.removeprefix("http://")
        assert netloc.rsplit(":", 1)[0] == (f"[{host}]" if ":" in host else host)
        assert request(p.url, get("/", host=netloc)).status == 200
        assert request(p.url, get("/", host="evil.example")).status == 421
        _clean(p)


@pytest.fixture
def own_pg() -> Iterator[str]:
    """A migrated PostgreSQL database of this test's own (the session's is
    seeded for the other tests of this module)."""
    with pg_database() as url:
        reset_tables(url)
        yield url


@pytest.mark.postgres
def test_views_beyond_the_pool_get_503(own_pg: str, tmp_path: Path) -> None:
    """Every view thread stuck on a locked table (PostgreSQL: SQLite readers
    do not wait for a writer): the rest wait, then 503 (the old process
    started a thread for each and queued them all)."""
    url = own_pg
    with dashboard_process(url, tmp_path) as p:
        engine = sa.create_engine(url)
        try:
            with engine.connect() as locker:
                locker.execute(sa.text("LOCK TABLE duebox_job IN ACCESS EXCLUSIVE MODE"))
                n = DEFAULT.threads + 4
                with ThreadPoolExecutor(n) as pool:
                    futures = [pool.submit(_get, p.url + "/jobs?state=DEAD", 60)
                               for _ in range(n)]
                    deadline = time.monotonic() + DEFAULT.queue_wait + 20
                    while sum(f.done() for f in futures) < 4:
                        assert time.monotonic() < deadline, "no request was refused"
                        time.sleep(0.05)
                    threads = p.threads()
                    locker.rollback()
                    results = Counter(f.result()[0] for f in futures)
        finally:
            engine.dispose()
        assert results == {200: DEFAULT.threads, 503: 4}, results
        assert threads <= DEFAULT.threads + 3, threads
        _clean(p)
