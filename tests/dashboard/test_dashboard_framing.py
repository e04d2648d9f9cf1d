"""The dashboard's HTTP framing, tried over raw sockets: lengths that are not
lengths, bodies nobody asked for, half heads, drip-fed heads and bodies.

Each refusal must come at once, before a body byte is sent (our side of the
socket stays open: a server that waits for the body never answers), and
nothing is logged at ERROR."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

import duebox
from duebox.dashboard.server import Limits

from .conftest import TOKEN, Client
from .seed import Seeded
from .wire import connect, get, read_reply, request, waits_for_close

Serve = Callable[..., Client]
ACTION = "/dlq/purge"


@contextmanager
def statements(app: duebox.Duebox) -> Iterator[list[str]]:
    """Every SQL statement the app's engine runs meanwhile."""
    seen: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    sa.event.listen(app.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        sa.event.remove(app.engine, "before_cursor_execute", count)


def _head(path: str, length: str, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {length}\r\n"
            f"{extra}\r\n").encode()


def _no_errors(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.parametrize("length", ["-1", "abc", "1.5", "+5", "0x10", "", "5, 6", "٣",
                                    "5\x00"])
def test_a_length_that_is_not_one_number_is_400_before_any_body(
        sqlite_seeded: Seeded, serve: Serve, caplog: pytest.LogCaptureFixture,
        length: str) -> None:
    """``-1`` made the old server read until the client closed (a 64 MiB
    body, before authentication); ``abc`` dropped the connection with a
    traceback."""
    c = serve(sqlite_seeded.app, token=TOKEN)
    with statements(sqlite_seeded.app) as ran:
        reply = request(c.base, _head(ACTION, length), timeout=5)
    assert (reply.status, reply.closed) == (400, True), reply
    assert b"Content-Length" in reply.body
    assert ran == []
    _no_errors(caplog)


def test_conflicting_lengths_and_transfer_encoding_are_refused(sqlite_seeded: Seeded,
                                                               serve: Serve) -> None:
    c = serve(sqlite_seeded.app, token=TOKEN)
    two = _head(ACTION, "5", "Content-Length: 6\r\n")
    assert request(c.base, two, timeout=5).status == 400
    chunked = (b"POST /dlq/purge HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
               b"\r\n5\r\nhello\r\n0\r\n\r\n")
    reply = request(c.base, chunked, timeout=5)
    assert (reply.status, reply.closed) == (411, True)
    # Both at once (the classic request-smuggling pair) is refused too.
    both = _head(ACTION, "5", "Transfer-Encoding: chunked\r\n")
    assert request(c.base, both, timeout=5).status == 411
    # Equal repeats are one length.
    same = _head(ACTION, "0", "Content-Length: 0\r\n")
    assert request(c.base, same, timeout=5).status == 403  # the form has no CSRF field


def test_a_body_over_the_limit_is_413_before_it_is_sent(sqlite_seeded: Seeded,
                                                        serve: Serve) -> None:
    c = serve(sqlite_seeded.app, token=TOKEN)
    for length in (str(Limits().max_body + 1), str(64 * 1024 * 1024), "9" * 40):
        reply = request(c.base, _head(ACTION, length), timeout=5)
        assert (reply.status, reply.closed) == (413, True), (length, reply)


def test_bodies_are_read_only_for_requests_that_need_one(sqlite_seeded: Seeded,
                                                         serve: Serve) -> None:
    """A refusal that the head decides comes without waiting for the body:
    the old server read the body of every POST first."""
    s = sqlite_seeded
    read_only = serve(s.app)
    reply = request(read_only.base, _head(ACTION, "100"), timeout=5)
    assert (reply.status, reply.closed) == (403, True)
    assert b"read-only" in reply.body
    c = serve(s.app, token=TOKEN)
    for origin in ("null", "http://evil.example", "http://127.0.0.1.evil.example"):
        reply = request(c.base, _head(ACTION, "100", f"Origin: {origin}\r\n"), timeout=5)
        assert (reply.status, b"cross-site" in reply.body) == (403, True), origin
    reply = request(c.base, _head("/nowhere", "100"), timeout=5)
    assert (reply.status, reply.closed) == (404, True)
    reply = request(c.base, _head(ACTION, "100", "Host: evil.example\r\n").replace(
        b"Host: 127.0.0.1\r\n", b""), timeout=5)
    assert reply.status == 421
    # A GET with a body is answered; the unread body closes the connection.
    reply = request(c.base, get("/", extra="Content-Length: 50\r\n"), timeout=5)
    assert (reply.status, reply.closed) == (200, True)


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: 1\r\n continued\r\n\r\n",  # obs-fold
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length : 0\r\n\r\n",  # space before colon
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\x00b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: a\nb\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",  # no Host
    b"GET /\xc3\xa9 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # raw (not percent-encoded) bytes
    b"GET http://evil.example/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET / HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS to a plain port
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nNoColon\r\n\r\n",
])
def test_malformed_heads_are_400(sqlite_seeded: Seeded, serve: Serve, raw: bytes,
                                 caplog: pytest.LogCaptureFixture) -> None:
    c = serve(sqlite_seeded.app)
    with statements(sqlite_seeded.app) as ran:
        reply = request(c.base, raw, timeout=5)
    assert (reply.status, reply.closed) == (400, True), reply
    assert ran == []
    _no_errors(caplog)


def test_limits_on_the_head_and_the_protocol(sqlite_seeded: Seeded, serve: Serve) -> None:
    c = serve(sqlite_seeded.app)
    huge = get("/jobs?q=" + "x" * (Limits().max_head + 10))
    assert request(c.base, huge, timeout=5).status == 431
    many = get("/", extra="".join(f"X-{i}: {i}\r\n" for i in range(150)))
    assert request(c.base, many, timeout=5).status == 431
    assert request(c.base, b"GET / HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n", timeout=5).status == 505
    expect = get("/", extra="Expect: something-else\r\n")
    assert request(c.base, expect, timeout=5).status == 417


def test_a_half_head_is_never_run(sqlite_seeded: Seeded, serve: Serve) -> None:
    """A client that closes before the blank line ending the head sent no
    request: the old server ran each such half head as a whole request."""
    c = serve(sqlite_seeded.app)
    with statements(sqlite_seeded.app) as ran:
        socks = [connect(c.base) for _ in range(20)]
        for sock in socks:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            sock.shutdown(socket.SHUT_WR)
        for sock in socks:
            assert read_reply(sock, 10).status in (400, None)
            sock.close()
    assert ran == []
    assert c.get("/processes").status == 200  # a request after them all is served


def test_keep_alive_pipelining_head_and_continue(sqlite_seeded: Seeded, serve: Serve) -> None:
    s = sqlite_seeded
    c = serve(s.app, token=TOKEN)
    with connect(c.base) as sock:
        sock.sendall(get("/processes") + get("/static/dashboard.js"))  # pipelined
        first, second = read_reply(sock), read_reply(sock)
        assert (first.status, second.status) == (200, 200)
        assert b"Relays and workers" in first.body
        assert second.headers["content-type"].startswith("text/javascript")
        sock.sendall(b"HEAD /processes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = read_reply(sock, head_only=True)
        assert (head.status, head.body) == (200, b"")
        assert int(head.headers["content-length"]) > 0
        sock.sendall(get("/", extra="Connection: close\r\n"))
        assert read_reply(sock).closed
    # Expect: 100-continue: the go-ahead only once the head has passed.
    csrf = c.csrf("/dlq")
    cookie = next(iter(c.jar)).value
    form = f"csrf={csrf}&token={TOKEN}&operator=ann&reason=tidy&error_class=permanent".encode()
    with connect(c.base) as sock:
        sock.sendall(_head(ACTION, str(len(form)),
                           f"Expect: 100-continue\r\nCookie: duebox_csrf={cookie}\r\n"))
        sock.settimeout(5)
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(form)
        done = read_reply(sock)
        assert (done.status, done.headers.get("location", "")[:11]) == (303, "/dlq?flash="), done


def test_drip_fed_heads_and_stalled_bodies_are_cut_off(sqlite_seeded: Seeded,
                                                       serve: Serve) -> None:
    """The head's deadline counts from the moment it is awaited: a byte now
    and then does not extend it."""
    limits = Limits(head_timeout=1.0, body_timeout=1.0)
    c = serve(sqlite_seeded.app, token=TOKEN, limits=limits)
    with connect(c.base) as drip:
        start = time.monotonic()
        answered = b""
        for byte in get("/" + "x" * 100).decode():  # a byte every 0.1 s: 10+ s in all
            with contextlib.suppress(OSError):
                drip.sendall(byte.encode())
            drip.settimeout(0.1)  # the pace of the drip, and a look for an answer
            with contextlib.suppress(TimeoutError):
                answered = drip.recv(65536) or b"(closed)"
                break
        took = time.monotonic() - start
        assert answered.startswith((b"HTTP/1.1 408 ", b"(closed)")), answered
        assert took < 3, f"the drip kept the connection open for {took:.1f} s"
    with connect(c.base) as stall:
        stall.sendall(_head(ACTION, "40") + b"csrf=")
        reply = read_reply(stall, 5)
        assert (reply.status, reply.closed) == (408, True)
    with connect(c.base) as idle:  # a kept-alive connection that goes quiet
        idle.sendall(get("/processes"))
        assert read_reply(idle).status == 200
        assert waits_for_close(idle, 5) is not None
