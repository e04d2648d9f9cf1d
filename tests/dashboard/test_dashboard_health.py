"""``/healthz``: 200 while the database answers a read of duebox's tables,
503 with the reason (JSON) when it does not, in-process and from a real
``duebox dashboard`` process."""

from __future__ import annotations

import json
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import duebox

from .conftest import Client
from .procs import dashboard_process
from .seed import Seeded

Serve = Callable[..., Client]


def test_healthy_while_the_database_answers(seeded: Seeded, serve: Serve) -> None:
    c = serve(seeded.app)
    page = c.get("/healthz")
    assert page.status == 200, page.text
    assert json.loads(page.text) == {"status": "ok", "database": "ok"}
    with c.opener.open(urllib.request.Request(c.base + "/healthz", method="HEAD"),
                       timeout=10) as head:
        assert (head.status, head.read()) == (200, b"")
    assert c.post("/healthz", {}).status == 405
    assert json.loads(c.get("/healthz?verbose=1").text)["error"]["field"] == "verbose"


def _unhealthy(c: Client) -> str:
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(c.base + "/healthz", timeout=30)
    e = refused.value
    assert e.code == 503
    assert e.headers["Content-Type"] == "application/json"
    assert e.headers["Retry-After"] == "5"
    body = json.loads(e.read())
    e.close()
    assert body["status"] == "unavailable"
    return str(body["database"])


@contextmanager
def _served(serve: Serve, database_url: str) -> Iterator[Client]:
    app = duebox.Duebox(database_url)
    c = serve(app)
    try:
        yield c
    finally:
        c.server.stop()  # type: ignore[union-attr]  # before the app's engine goes
        app.dispose()


def test_unhealthy_when_the_database_is_unreachable(serve: Serve) -> None:
    # Nothing listens on port 1: the connection is refused at once.
    with _served(serve, "postgresql+psycopg://duebox@127.0.0.1:1/nowhere") as c:
        assert "database unavailable" in _unhealthy(c)


def test_unhealthy_without_duebox_tables(tmp_path: Path, serve: Serve) -> None:
    sqlite3.connect(tmp_path / "empty.db").close()
    with _served(serve, f"sqlite:///{tmp_path}/empty.db") as c:
        assert "duebox db upgrade" in _unhealthy(c)


def test_the_command_answers_healthz(seeded: Seeded, tmp_path: Path) -> None:
    url = seeded.app.settings.database_url
    with dashboard_process(url, tmp_path) as proc, \
            urllib.request.urlopen(proc.url + "/healthz", timeout=30) as r:
        assert r.status == 200
        assert json.loads(r.read())["status"] == "ok"
