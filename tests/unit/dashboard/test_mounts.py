"""duebox.dashboard.asgi / .wsgi at their boundary: a scope or an environ
in, one response out, every bad part of it refused by name before a view
runs (over real HTTP in tests/dashboard/test_dashboard_mounts.py)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

import duebox
from duebox.dashboard import asgi_app, wsgi_app
from duebox.dashboard.asgi import DashboardASGI, route_path


@pytest.fixture
def asgi(app: duebox.Duebox) -> Iterator[DashboardASGI]:
    dashboard = asgi_app(app)
    yield dashboard
    dashboard.close()


def _wsgi(app: duebox.Duebox, **environ: Any) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen.update(status=status, headers=dict(headers))

    base = {"REQUEST_METHOD": "GET", "SCRIPT_NAME": "/ops", "PATH_INFO": "/healthz",
            "QUERY_STRING": "", "HTTP_HOST": "localhost", "wsgi.input": io.BytesIO(b""),
            "REMOTE_ADDR": "127.0.0.1"}
    body = b"".join(wsgi_app(app)({**base, **environ}, start_response))
    return seen["status"], seen["headers"], body


def test_wsgi_answers_under_script_name(app: duebox.Duebox) -> None:
    status, headers, body = _wsgi(app)
    assert (status, json.loads(body)) == ("200 OK", {"status": "ok", "database": "ok"})
    status, headers, body = _wsgi(app, PATH_INFO="/jobs")
    assert status == "200 OK"
    assert 'action="/ops/jobs"' in body.decode()
    assert "Path=/ops/;" in headers["Set-Cookie"]
    status, headers, body = _wsgi(app, REQUEST_METHOD="HEAD")
    assert (status, body) == ("200 OK", b"")


@pytest.mark.parametrize(("environ", "status", "field"), [
    # PEP 3333: PATH_INFO and SCRIPT_NAME are bytes carried as latin-1.
    ({"PATH_INFO": "/api/jobs/\xed\xa0\x80"}, "400 Bad Request", "path"),
    ({"PATH_INFO": "/api/jobs/\x00"}, "400 Bad Request", "path"),
    ({"SCRIPT_NAME": "/\xff", "PATH_INFO": "/api/jobs"}, "400 Bad Request", "mount prefix"),
    ({"SCRIPT_NAME": "//evil.example", "PATH_INFO": "/api/jobs"}, "400 Bad Request",
     "mount prefix"),
    ({"SCRIPT_NAME": "/a/../b", "PATH_INFO": "/api/jobs"}, "400 Bad Request", "mount prefix"),
    ({"PATH_INFO": "/api/jobs", "QUERY_STRING": "q=\xe9"}, "400 Bad Request", "query"),
    ({"PATH_INFO": "/api/jobs", "QUERY_STRING": "x" * 3000 + "=1"}, "400 Bad Request",
     "query"),
    ({"PATH_INFO": "/api/jobs", "REQUEST_METHOD": "POST"}, "405 Method Not Allowed", None),
    ({"PATH_INFO": "/api/jobs", "HTTP_HOST": "evil.example"}, "421 Misdirected Request",
     None),
    ({"PATH_INFO": "/dlq/purge", "REQUEST_METHOD": "POST", "CONTENT_LENGTH": "-1"},
     "400 Bad Request", None),
])
def test_wsgi_refuses_a_bad_environ_by_name(app: duebox.Duebox, environ: dict[str, str],
                                            status: str, field: str | None) -> None:
    got, _, body = _wsgi(app, **environ)
    assert got == status, body[-300:]
    if environ.get("PATH_INFO", "").startswith("/api/"):
        assert json.loads(body)["error"]["field"] == field


def _asgi(dashboard: DashboardASGI, **scope: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []
    base = {"type": "http", "method": "GET", "path": "/duebox/healthz", "root_path": "/duebox",
            "query_string": b"", "headers": [(b"host", b"localhost")],
            "client": ("127.0.0.1", 5000)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(dashboard({**base, **scope}, receive, send))  # type: ignore[arg-type]
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_asgi_answers_below_root_path(asgi: DashboardASGI) -> None:
    status, headers, body = _asgi(asgi)
    assert (status, json.loads(body)["status"]) == (200, "ok")
    status, headers, body = _asgi(asgi, path="/duebox/jobs")
    assert status == 200
    assert b'action="/duebox/jobs"' in body
    assert b"Path=/duebox/;" in headers[b"set-cookie"]
    # A server that strips the prefix from path itself.
    assert _asgi(asgi, path="/healthz")[0] == 200


@pytest.mark.parametrize(("scope", "status", "field"), [
    ({"path": "/duebox/api/jobs/\ufffd", "raw_path": b"/duebox/api/jobs/%ed%a0%80"}, 400,
     "path"),
    ({"path": "/x/../duebox/api/jobs", "root_path": "/x/../duebox"}, 400, "mount prefix"),
    ({"path": "/api/jobs", "root_path": "//evil.example"}, 400, "mount prefix"),
    ({"path": "/duebox/api/jobs", "query_string": b"q=\xe9"}, 400, "query"),
    ({"path": "/duebox/api/jobs", "method": "DELETE"}, 405, None),
    ({"path": "/duebox/api/jobs", "headers": [(b"host", b"evil.example")]}, 421, None),
])
def test_asgi_refuses_a_bad_scope_by_name(asgi: DashboardASGI, scope: dict[str, Any],
                                          status: int, field: str | None) -> None:
    got, _, body = _asgi(asgi, **scope)
    assert got == status, body[-300:]
    assert json.loads(body)["error"]["field"] == field


def test_route_path_takes_the_prefix_off_once() -> None:
    assert route_path({"path": "/duebox/jobs", "root_path": "/duebox"}) == "/jobs"
    assert route_path({"path": "/duebox", "root_path": "/duebox"}) == "/"
    assert route_path({"path": "/jobs", "root_path": "/duebox"}) == "/jobs"
    assert route_path({"path": "/dueboxes/jobs", "root_path": "/duebox"}) == "/dueboxes/jobs"


def test_asgi_closes_a_websocket(asgi: DashboardASGI) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    asyncio.run(asgi({"type": "websocket", "path": "/"}, receive, send))  # type: ignore[arg-type]
    assert sent == [{"type": "websocket.close", "code": 1008}]
