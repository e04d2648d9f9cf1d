"""duebox.dashboard.http11: a request head is parsed into a Head or refused
with its status — never another exception, whatever the bytes — and the
stream side tells a clean close from half a request.

Over a real socket (pipelining, drip-fed heads, stalled bodies) this is
tests/dashboard/test_dashboard_framing.py's."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox.dashboard.http11 import (
    MAX_HEADERS,
    Head,
    ProtocolError,
    encode_response,
    parse_head,
    read_body,
    read_head,
)


def status_of(raw: bytes) -> int | Head:
    try:
        return parse_head(raw)
    except ProtocolError as refused:
        return refused.status


def test_a_request_head_with_its_headers() -> None:
    head = parse_head(b"POST /dlq/replay?x=1 HTTP/1.1\r\nHost: h:8377\r\nContent-Length: 12\r\n"
                      b"Cookie: a=1\r\nCookie: b=2\r\nAccept: x\r\nAccept: y\r\n"
                      b"Connection: keep-alive, Close")
    assert (head.method, head.target, head.version, head.length) == (
        "POST", "/dlq/replay?x=1", (1, 1), 12)
    assert head.headers["cookie"] == "a=1; b=2"
    assert head.headers["accept"] == "x, y"
    assert not head.keep_alive
    assert parse_head(b"GET / HTTP/1.1\r\nhost: h").keep_alive
    assert not parse_head(b"GET / HTTP/1.0").keep_alive  # 1.0: no Host needed, no keep-alive
    assert parse_head(b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue").expects_continue


@pytest.mark.parametrize(("raw", "status"), [
    (b"GET /\r\nHost: h", 400),
    (b"GET  / HTTP/1.1\r\nHost: h", 400),
    (b"G(T / HTTP/1.1\r\nHost: h", 400),
    (b"GET / HTTP/2.0\r\nHost: h", 505),
    (b"GET / HTTP/1.10\r\nHost: h", 400),
    (b"GET http://h/ HTTP/1.1\r\nHost: h", 400),
    (b"GET /\xc3\xa9 HTTP/1.1\r\nHost: h", 400),
    (b"GET / HTTP/1.1", 400),  # no Host
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b", 400),
    (b"GET / HTTP/1.1\r\nHost : h", 400),
    (b"GET / HTTP/1.1\r\nHost: h\r\n folded", 400),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b", 400),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x1bb", 400),
    (b"GET / HTTP/1.1\r\nHost: h\nX: bare-lf", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1, 2", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 2", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0x10", 400),
    (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked", 411),
    (b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 200-ok", 417),
    (b"GET / HTTP/1.1\r\nHost: h" + b"\r\nX: y" * MAX_HEADERS, 431),
])
def test_a_head_that_cannot_be_framed_is_refused_with_its_status(raw: bytes, status: int
                                                                 ) -> None:
    assert status_of(raw) == status


def test_repeated_lengths_that_agree_are_one_length_and_a_huge_one_stays_huge() -> None:
    assert parse_head(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 7\r\n"
                      b"Content-Length: 7, 7").length == 7
    huge = parse_head(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: " + b"9" * 5000)
    assert huge.length >= 10**18


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.lists(
    st.sampled_from([b"GET", b"POST", b" ", b"/", b"HTTP/1.1", b"\r\n", b"Host:", b"h",
                     b"Content-Length:", b"5", b",", b"\x00", b"\n", b":", b"\t", b"\xff"]),
    max_size=20).map(b"".join))
def test_any_bytes_are_a_head_or_a_refusal(raw: bytes) -> None:
    result = status_of(raw)
    assert isinstance(result, Head) or result in (400, 411, 417, 431, 505)


def test_a_response_has_one_length_and_a_head_only_one_no_body() -> None:
    out = encode_response(404, [("Content-Length", "999"), ("Connection", "keep-alive"),
                                ("X-A", "b")], b"gone", close=True)
    assert out == (b"HTTP/1.1 404 Not Found\r\nX-A: b\r\nContent-Length: 4\r\n"
                   b"Connection: close\r\n\r\ngone")
    assert encode_response(299, [], b"x", head_only=True) == (
        b"HTTP/1.1 299 \r\nContent-Length: 1\r\n\r\n")


def stream(data: bytes, *, limit: int = 2**16, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=limit)
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_reading_heads_off_a_stream() -> None:
    two = stream(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\nGET /b HTTP/1.1\r\nHost: h\r\n\r\n")
    first, second = await read_head(two, 10), await read_head(two, 10)
    assert first is not None
    assert second is not None
    assert (first.target, second.target) == ("/a", "/b")
    assert await read_head(two, 10) is None  # closed cleanly between requests
    assert await read_head(stream(b"\r\n"), 10) is None


@pytest.mark.parametrize(("data", "limit", "status"), [
    (b"GET / HTTP/1.1\r\nHost: h\r\n", 2**16, 400),  # closed mid-head: never run
    (b"GET /" + b"a" * 200 + b" HTTP/1.1\r\nHost: h\r\n\r\n", 64, 431),
])
async def test_a_half_or_oversized_head_is_refused(data: bytes, limit: int, status: int) -> None:
    with pytest.raises(ProtocolError) as refused:
        await read_head(stream(data, limit=limit), 10)
    assert refused.value.status == status


async def test_a_body_is_read_whole_or_refused() -> None:
    assert await read_body(stream(b"abcdef"), 3, 10) == b"abc"
    with pytest.raises(ProtocolError) as refused:
        await read_body(stream(b"ab"), 3, 10)
    assert refused.value.status == 400
