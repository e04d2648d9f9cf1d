"""The dashboard mounted under a prefix in a host app, over real HTTP:
FastAPI under uvicorn (``asgi_app``) and Flask under wsgiref (``wsgi_app``).
Its links, redirects and cookie stay under the prefix; its pages, JSON API
and /healthz answer as on its own server; actions keep the token, CSRF,
origin and Host checks; hostile prefixes, paths and queries are refused by
name."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import job_row

from duebox.tables import audit

from .conftest import TOKEN, Client
from .mounted import PREFIX, mounted
from .seed import SECRET, Seeded
from .wire import get, post, request

KINDS = ["asgi", "wsgi"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def reading(kind: str, seeded: Seeded) -> Iterator[Client]:
    """A read-only mount on the seeded database (both databases)."""
    with mounted(kind, seeded.app) as url:
        yield Client(url + PREFIX[kind])


def _links(html: str) -> set[str]:
    return set(re.findall(r'(?:href|action|src)="([^"]*)"', html))


def test_links_redirects_and_cookie_stay_under_the_prefix(kind: str, seeded: Seeded,
                                                         reading: Client) -> None:
    prefix = PREFIX[kind]
    host = reading.base.removesuffix(prefix)
    assert json.loads(Client(host).get("/").text) == {"shop": True}, "the host app's own page"
    for path in ("/", "/jobs", f"/jobs/{seeded.dead[0]}", "/dlq", "/schedules",
                 f"/schedules/{seeded.schedule_id}", "/processes"):
        page = reading.get(path)
        assert page.status == 200, (path, page.text[-300:])
        links = _links(page.text)
        assert links, path
        outside = {link for link in links if not link.startswith(prefix + "/")}
        assert outside == set(), (path, outside)
        assert SECRET not in page.text
    assert reading.get("/static/dashboard.js").status == 200
    (cookie,) = reading.jar
    assert cookie.path == prefix + "/"
    found = reading.get("/jobs?q=order-1")  # one match: redirected to the job's page
    assert found.url == f"{reading.base}/jobs/{seeded.dead[1]}"


def test_json_api_and_healthz_through_the_mount(seeded: Seeded, reading: Client) -> None:
    dead = json.loads(reading.get("/api/jobs?state=DEAD").text)
    assert {j["id"] for j in dead["jobs"]} == {str(i) for i in seeded.dead}
    job = reading.get(f"/api/jobs/{seeded.dead[0]}")
    assert SECRET not in job.text
    assert json.loads(job.text)["masking"]["payload"]["card"] == "****1111"
    assert json.loads(reading.get("/healthz").text) == {"status": "ok", "database": "ok"}
    bad = reading.get("/api/jobs?limit=1000")
    assert bad.status == 400
    assert json.loads(bad.text)["error"]["field"] == "limit"


@pytest.mark.parametrize(("path", "status", "field"), [
    ("/api/jobs?q=" + "x" * 2001, 400, "q"),
    ("/api/jobs?" + "&".join(f"f{i}=1" for i in range(60)), 400, "query"),
    ("/api/jobs?q=%ff%fe", 400, "query"),
    ("/api/jobs?queue=%1b%5b31m", 400, "queue"),
    ("/api/jobs/%00", 400, "path"),
    ("/api/jobs/%ed%a0%80", 400, "path"),
    ("/api/dlq?error_class=x", 400, "error_class"),
    ("/api/..%2f..%2fetc%2fpasswd", 404, None),
    ("/static/..%2f..%2fpyproject.toml", 404, None),
])
def test_hostile_queries_are_refused_naming_the_field(kind: str, reading: Client, path: str,
                                                      status: int, field: str | None) -> None:
    reply = request(reading.base, get(PREFIX[kind] + path))
    assert reply.status == status, (path, reply.body[-300:])
    if path.startswith("/api/"):
        assert json.loads(reply.body)["error"]["field"] == field


def test_wrong_methods_are_405(kind: str, reading: Client) -> None:
    for method in ("DELETE", "PUT", "PATCH"):
        raw = f"{method} {PREFIX[kind]}/api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n" \
              "Content-Length: 0\r\nConnection: close\r\n\r\n"
        reply = request(reading.base, raw.encode())
        assert reply.status == 405, (method, reply.body)
        assert reply.headers["allow"] == "GET, HEAD"


def _audits(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(audit)))


def test_actions_keep_their_guard_under_a_mount(kind: str, sqlite_seeded: Seeded) -> None:
    s = sqlite_seeded
    prefix = PREFIX[kind]
    action = f"{prefix}/jobs/{s.dead[0]}/replay"
    form = {"operator": "alice", "reason": "card fixed", "token": TOKEN}
    with mounted(kind, s.app) as url:  # read-only: no token given
        c = Client(url + prefix)
        assert "name=token" not in c.get(f"/jobs/{s.dead[0]}").text
        refused = c.post(f"/jobs/{s.dead[0]}/replay", form)
        assert (refused.status, "read-only" in refused.text) == (403, True)
    with mounted(kind, s.app, token=TOKEN) as url:
        c = Client(url + prefix)
        csrf = c.csrf(f"/jobs/{s.dead[0]}")
        good = {**form, "csrf": csrf}
        assert c.post(f"/jobs/{s.dead[0]}/replay", {**form, "csrf": "1.x"}).status == 403
        cross = c.post(f"/jobs/{s.dead[0]}/replay", good,
                       headers={"Origin": "http://evil.example"})
        assert (cross.status, "cross-site" in cross.text) == (403, True)
        cookie = next(iter(c.jar)).value
        body = urllib.parse.urlencode(good).encode()
        rebound = request(url, post(action, body, host="evil.example",
                                    extra=f"Cookie: duebox_csrf={cookie}\r\n"))
        assert rebound.status == 421, "a foreign Host is refused under a mount too"
        # Refused on its head: the body is not even sent (a server that
        # closes on unread bytes would reset the connection).
        big = request(url, f"POST {action} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           f"Content-Length: {64 * 1024}\r\nCookie: duebox_csrf={cookie}\r\n"
                           "Connection: close\r\n\r\n".encode())
        assert big.status == 413
        assert job_row(s.app.engine, s.dead[0]).state == "DEAD"
        assert _audits(s.app.engine) == []
        done = c.post(f"/jobs/{s.dead[0]}/replay", good)
        assert done.status == 200, done.text[-300:]
        assert done.url.startswith(f"{url}{prefix}/jobs/{s.dead[0]}?flash="), done.url
        assert "replayed 1" in done.text
    assert job_row(s.app.engine, s.dead[0]).state == "SCHEDULED"
    assert [(a.action, a.operator) for a in _audits(s.app.engine)] == [("replay", "alice")]


@pytest.mark.parametrize("tenant", ["..", ".", "%22%3E%3Cscript%3E", "a%0d%0aSet-Cookie:x=1",
                                    "%c3%a9", "a%20b", "x" * 201])
def test_a_hostile_mount_prefix_is_refused(seeded: Seeded, tenant: str) -> None:
    """A prefix built from the request (a mount with a path parameter) that
    would not be a safe link: refused by name, its text nowhere in the
    answer."""
    from fastapi import FastAPI

    from duebox.dashboard import asgi_app

    from .mounted import uvicorn_serving

    web = FastAPI()
    dashboard = asgi_app(seeded.app)
    web.mount("/{tenant}/duebox", dashboard)
    try:
        with uvicorn_serving(web) as url:
            ok = request(url, get("/acme/duebox/api/jobs?limit=1"))
            assert ok.status == 200, ok.body[-300:]
            reply = request(url, get(f"/{tenant}/duebox/api/jobs"))
            assert reply.status == 400, (tenant, reply.status, reply.body[-300:])
            error = json.loads(reply.body)["error"]
            assert error["field"] == "mount prefix"
            assert "set-cookie" not in reply.headers
            page = request(url, get(f"/{tenant}/duebox/"))
            assert page.status == 400
            assert b"<script>" not in page.body
            assert 'href="/"' in page.body.decode()
    finally:
        dashboard.close()
