"""Hostile paths and query strings, on SQLite and PostgreSQL (which refuses
NUL in text, where SQLite accepts it): a bad field is a 400 that names it,
never a 500, and nothing is logged at ERROR (or WARNING)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import timedelta, timezone
from urllib.parse import quote_from_bytes

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duebox.dashboard import DashboardServer

from .seed import Seeded
from .wire import get, request

# Each page and the fields it reads.
PAGES = {"/": ["ahead", "flash"], "/jobs": ["q", "queue", "state", "from", "to", "after"],
         "/dlq": ["task", "error_class", "after"], "/schedules": ["after", "flash"],
         "/processes": [], "/schedules/{ref}": ["flash"], "/jobs/{ref}": ["flash"],
         "/static/{ref}": [],
         # The JSON API: its refusals are JSON objects naming the field.
         "/api/overview": ["ahead"], "/api/queues": [], "/api/processes": [],
         "/api/jobs": ["q", "queue", "state", "from", "to", "after", "limit"],
         "/api/jobs/{ref}": [], "/api/dlq": ["task", "error_class", "after", "limit"],
         "/api/schedules": ["after", "limit"], "/api/schedules/{ref}": []}
# What makes a value hostile: NUL, invalid UTF-8 (a stray byte, an encoded
# surrogate, an overlong NUL), control characters (ESC, DEL, C1 NEL, CRLF),
# an RTL override, and sizes past the field limit.
FRAGMENTS = [b"\x00", b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\x80", b"\x1b[31m", b"\x7f",
             b"\xc2\x85", b"\r\n", b"\xe2\x80\xae", b"x" * 2001, b"9" * 400]
NASTY = [*FRAGMENTS, b"a\x00b", b"%00", "n\u0303".encode(), b"../../etc/passwd",
         b"2026-13-45T99:99", b"_"]
@pytest.fixture
def server(seeded: Seeded) -> Iterator[DashboardServer]:
    s = DashboardServer(seeded.app, port=0).start()
    try:
        yield s
    finally:
        s.stop()


def _quiet(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.levelname} {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("duebox")]


@pytest.mark.parametrize(("path", "field"), [
    ("/jobs?q=%00", "q"), ("/jobs?queue=a%00b", "queue"), ("/dlq?task=%00", "task"),
    ("/schedules/a%00b", "path"), ("/schedules?after=%00", "after"),
    ("/jobs?q=%ff%fe", "query"), ("/jobs?queue=%1b%5b31m", "queue"),
    ("/jobs?q=" + "x" * 2001, "q"), ("/jobs/%00", "path"), ("/%ed%a0%80", "path"),
    ("/jobs?" + "&".join(f"f{i}=1" for i in range(60)), "query"),
    ("/jobs?from=0001-01-01T00:00%2B23:59", "from"), ("/jobs?to=0001-01-01T00:00%2B01:00", "to"),
    ("/jobs?after=0001-01-01T00:00%2B23:59_01a2324c-c426-731c-b4ef-1a859e0d1713", "after"),
])
def test_bad_query_input_is_400_naming_the_field(server: DashboardServer, path: str,
                                                 field: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """On PostgreSQL each of the first ones was a 500 with a traceback at ERROR."""
    reply = request(server.url, get(path), timeout=10)
    assert reply.status == 400, (path, reply)
    assert f"{field}: ".encode() in reply.body, reply.body[-400:]
    assert _quiet(caplog) == []


# Times at the ends of the calendar, with offsets up to a day either way,
# and anywhere between.
EDGE_INSTANTS = st.tuples(
    st.sampled_from(["0001-01-01", "9999-12-31"]), st.sampled_from(["T00:00", " 23:59:59.999999"]),
    st.sampled_from(["", "Z", "+23:59", "-23:59", "+01:00", "-00:00:00.000001"]),
).map(lambda parts: "".join(parts).encode())
INSTANTS = st.one_of(EDGE_INSTANTS, st.datetimes(timezones=st.one_of(
    st.none(), st.timedeltas(min_value=-timedelta(hours=23, minutes=59),
                             max_value=timedelta(hours=23, minutes=59)).map(timezone))
).map(lambda at: at.isoformat().encode()))


HOSTILE = st.builds(lambda a, bad, b: a + bad + b, st.binary(max_size=12),
                    st.sampled_from(FRAGMENTS), st.binary(max_size=12))


@st.composite
def hostile_requests(draw: st.DrawFn) -> str:
    """A page, and fields it reads (and others) with hostile values."""
    page = draw(st.sampled_from(sorted(PAGES)))
    names = st.one_of(st.sampled_from(PAGES[page] or ["x"]), st.binary(max_size=8))
    values = st.one_of(HOSTILE, st.sampled_from(NASTY), INSTANTS, st.binary(max_size=60),
                       st.text(max_size=30).map(lambda t: t.encode("utf-8", "surrogatepass")))
    params = draw(st.dictionaries(names, values, min_size=1, max_size=4))
    if "{ref}" in page:
        page = page.format(ref=quote_from_bytes(draw(st.one_of(HOSTILE, st.binary(min_size=1))),
                                                safe=""))
    query = "&".join(f"{quote_from_bytes(k.encode() if isinstance(k, str) else k, safe='')}="
                     f"{quote_from_bytes(v, safe='')}" for k, v in params.items())
    return f"{page}?{query}"


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=hostile_requests())
def test_no_query_makes_a_server_error(server: DashboardServer, path: str,
                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    reply = request(server.url, get(path), timeout=30)
    assert reply.status in (200, 303, 400, 404, 431), (path, reply.status, reply.body[-300:])
    assert _quiet(caplog) == [], path
    if path.startswith("/api/") and reply.status != 431:
        assert reply.headers["content-type"] == "application/json", path
        json.loads(reply.body)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(field=st.sampled_from(["from", "to", "after"]), at=INSTANTS)
def test_no_time_makes_a_server_error(server: DashboardServer, field: str, at: bytes,
                                      caplog: pytest.LogCaptureFixture) -> None:
    """Times at the ends of the calendar, in every offset: a search range
    or a page cursor that cannot be a UTC instant is a bad field."""
    caplog.clear()
    value = at + b"_01a2324c-c426-731c-b4ef-1a859e0d1713" if field == "after" else at
    path = f"/jobs?{field}={quote_from_bytes(value, safe='')}"
    reply = request(server.url, get(path), timeout=30)
    assert reply.status in (200, 400), (path, reply.status, reply.body[-300:])
    assert _quiet(caplog) == [], path
