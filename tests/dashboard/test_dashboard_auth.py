"""Who may act: failed authentication is throttled (per client address and in
total) before any work, CSRF fields expire, and only this dashboard's own
pages may post (no ``Origin: null``, no other site)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from urllib.parse import urlencode

import pytest

import duebox
from duebox.dashboard.security import CSRF_MAX_AGE

from .conftest import TOKEN, Client
from .seed import Seeded, seeded_app
from .test_dashboard_framing import statements
from .wire import Reply, post, request

Serve = Callable[..., Client]
ACTION = "/dlq/purge"


@pytest.fixture
def faked(sqlite_seeded: Seeded) -> Iterator[duebox.Duebox]:
    """The seeded database through an app whose clock the test moves."""
    app = seeded_app(sqlite_seeded.app.settings.database_url,
                     clock=duebox.FakeClock(datetime.now(UTC)))
    try:
        yield app
    finally:
        app.dispose()


class Browser:
    """A CSRF cookie and field from the dashboard, and raw POSTs with them
    from any loopback address."""

    def __init__(self, c: Client, page: str = "/dlq") -> None:
        self.c = c
        self.host = c.base.removeprefix("http://")
        self.csrf = c.csrf(page)
        self.cookie = next(iter(c.jar)).value

    def post(self, token: str, *, source: str | None = None, extra: str = "",
             **fields: str) -> Reply:
        form = {"csrf": self.csrf, "token": token, "operator": "eve", "reason": "guessing",
                "error_class": "transient", **fields}
        raw = post(ACTION, urlencode(form).encode(), host=self.host,
                   extra=f"Cookie: duebox_csrf={self.cookie}\r\n{extra}")
        return request(self.c.base, raw, source=source, timeout=10)


def test_wrong_tokens_are_throttled_per_client_before_any_work(
        faked: duebox.Duebox, serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    """1,000 wrong tokens as fast as they come: the old dashboard answered
    every one 403 after comparing it (its limit counted only actions that
    passed the token check)."""
    c = serve(faked, token=TOKEN)
    b = Browser(c)
    start = time.monotonic()
    replies = [b.post(f"guess-{i:04d}") for i in range(1000)]
    took = time.monotonic() - start
    statuses = Counter(r.status for r in replies)
    assert statuses == {403: 10, 429: 990}, statuses
    assert all(int(r.headers["retry-after"]) >= 1 for r in replies if r.status == 429)
    print(f"1,000 wrong tokens: {dict(statuses)} in {took:.2f} s")
    # Throttled means refused before the token is looked at: the right one too,
    # and without reading a body or touching the database.
    with statements(faked) as ran:
        assert b.post(TOKEN).status == 429
        head_only = (f"POST {ACTION} HTTP/1.1\r\nHost: {b.host}\r\n"
                     "Content-Length: 50\r\n\r\n").encode()  # the body is never sent
        assert request(c.base, head_only, timeout=5).status == 429
    assert ran == []
    # Another client is not held back by this one.
    assert b.post("wrong-again", source="127.0.0.2").status == 403
    # Retry-After means it: once that much time has passed, the right token works.
    assert isinstance(faked.clock, duebox.FakeClock)
    faked.clock.advance(int(replies[-1].headers["retry-after"]))
    assert b.post(TOKEN).status == 303
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("127.0.0.1 failed to authenticate" in w for w in warnings) == 1, warnings
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_failed_authentication_is_also_throttled_in_total(faked: duebox.Duebox,
                                                          serve: Serve) -> None:
    """Guessing from many addresses: each stays under its own limit, the
    total limit stops them all (a new address included) for a while."""
    c = serve(faked, token=TOKEN)
    b = Browser(c)
    statuses: Counter[int | None] = Counter()
    for host in range(2, 12):
        for i in range(10):
            statuses[b.post(f"guess-{i}", source=f"127.0.0.{host}").status] += 1
    assert statuses == {403: 100}, statuses
    fresh = b.post(TOKEN, source="127.0.0.200")
    assert fresh.status == 429, fresh
    assert isinstance(faked.clock, duebox.FakeClock)
    faked.clock.advance(int(fresh.headers["retry-after"]))
    assert b.post(TOKEN, source="127.0.0.200").status == 303


def test_csrf_fields_expire(faked: duebox.Duebox, serve: Serve) -> None:
    """The old field was an HMAC of the cookie alone: valid while the
    process lived."""
    c = serve(faked, token=TOKEN)
    old = Browser(c)
    assert isinstance(faked.clock, duebox.FakeClock)
    faked.clock.advance(CSRF_MAX_AGE + 1)
    expired = old.post(TOKEN)
    assert expired.status == 403
    assert b"expired" in expired.body
    fresh = Browser(c)
    assert fresh.post(TOKEN).status == 303
    # The time in the field is signed: moving it forward does not help.
    issued, _, mac = old.csrf.partition(".")
    old.csrf = f"{int(issued) + int(CSRF_MAX_AGE)}.{mac}"
    assert old.post(TOKEN).status == 403
    old.csrf = mac  # the field as the old dashboard made it
    assert old.post(TOKEN).status == 403


@pytest.mark.parametrize(("header", "allowed"), [
    ("Origin: null", False),
    ("Origin: http://evil.example", False),
    ("Origin: http://127.0.0.1.evil.example", False),
    ("Origin: file://", False),
    ("Sec-Fetch-Site: cross-site", False),
    ("Sec-Fetch-Site: same-site", False),
    ("Origin: https://{host}", False),  # the same host and port, another scheme
    ("Origin: http://{host}:1", False),
    ("Origin: http://{host}", True),
    ("Sec-Fetch-Site: same-origin", True),
    ("", True),
])
def test_only_this_dashboards_pages_may_act(sqlite_seeded: Seeded, serve: Serve, header: str,
                                            allowed: bool) -> None:
    """``Origin: null`` (a sandboxed frame, some redirects) was accepted."""
    c = serve(sqlite_seeded.app, token=TOKEN)
    b = Browser(c)
    extra = f"{header.format(host=b.host)}\r\n" if header else ""
    reply = b.post(TOKEN, extra=extra)
    assert reply.status == (303 if allowed else 403), (header, reply)
    if not allowed:
        assert b"cross-site" in reply.body


@pytest.mark.parametrize(("host", "origin", "allowed"), [
    ("dash.example.com", "https://dash.example.com", True),  # a reverse proxy adds TLS
    ("dash.example.com", "http://dash.example.com", True),
    ("dash.example.com:8443", "https://dash.example.com:8443", True),
    ("dash.example.com", "https://dash.example.com:8443", False),
    ("dash.example.com", "https://other.example.com", False),
    ("dash.example.com", "ftp://dash.example.com", False),
    ("{own}", "https://{own}", False),  # reached directly: this dashboard speaks http only
])
def test_https_is_this_dashboards_origin_only_behind_a_proxy_name(
        sqlite_seeded: Seeded, serve: Serve, host: str, origin: str, allowed: bool) -> None:
    """An ``Origin`` of ``https://`` with the dashboard's own host and port
    was accepted, though the dashboard serves plain HTTP.  Under a name given
    with ``--allow-host`` (the one a reverse proxy forwards) a page may have
    been served over TLS by the proxy."""
    c = serve(sqlite_seeded.app, token=TOKEN, allow_hosts=["dash.example.com"])
    b = Browser(c)
    b.host = host.format(own=b.host)
    reply = b.post(TOKEN, extra=f"Origin: {origin.format(own=b.host)}\r\n")
    assert reply.status == (303 if allowed else 403), (host, origin, reply)
    if not allowed:
        assert b"cross-site" in reply.body


def test_a_persistent_guesser_is_logged_once_a_window(
        caplog: pytest.LogCaptureFixture) -> None:
    """A bucket refills a token every window/size seconds; a guesser who
    keeps trying empties it again each time.  That is still one episode:
    one WARNING a window, not one per refilled token (a slow run of the
    process test above logged it twice)."""
    from duebox.dashboard.throttle import Throttle

    now = [0.0]
    throttle = Throttle(lambda: now[0], per_client=10, overall=1000, window=60.0)
    with caplog.at_level(logging.WARNING, logger="duebox.dashboard"):
        for _ in range(10):
            throttle.failed("10.0.0.1")
        for _ in range(9):  # one token back every 6 s, taken at once
            now[0] += 6.0
            assert throttle.retry_after("10.0.0.1") is None
            throttle.failed("10.0.0.1")
        assert sum("failed to authenticate" in r.message for r in caplog.records) == 1
        now[0] += 6.0  # a whole window after the first line
        throttle.failed("10.0.0.1")
    assert sum("failed to authenticate" in r.message for r in caplog.records) == 2
