"""Fixtures: a seeded app, and the dashboard served in-process on a free port."""

from __future__ import annotations

import dataclasses
import http.cookiejar
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import reset_tables

from duebox.dashboard import DashboardServer

from .seed import Seeded, seed, seeded_app

TOKEN = "s3cret-operator-token"


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres",
                                                                marks=pytest.mark.postgres)])
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Seeded]:
    """Seeded once per module and database (running real jobs takes seconds):
    tests that use it only read, or put back what they change."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('seeded')}/dash.db"
    else:
        url = request.getfixturevalue("pg_server_url")
    reset_tables(url)
    app = seeded_app(url)
    try:
        yield seed(app)
    finally:
        app.dispose()


@pytest.fixture(scope="module")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Seeded]:
    path = tmp_path_factory.mktemp("template") / "dash.db"
    url = f"sqlite:///{path}"
    reset_tables(url)
    app = seeded_app(url)
    seeded = seed(app)
    app.dispose()  # closes the WAL into the file, so a copy is complete
    return path, seeded


@pytest.fixture
def sqlite_seeded(_sqlite_template: tuple[Path, Seeded], tmp_path: Path) -> Iterator[Seeded]:
    """A private copy of the seeded SQLite database, for tests that change it."""
    template, ids = _sqlite_template
    copy = tmp_path / "dash.db"
    shutil.copyfile(template, copy)
    app = seeded_app(f"sqlite:///{copy}")
    try:
        yield dataclasses.replace(ids, app=app)
    finally:
        app.dispose()


@dataclass
class Page:
    status: int
    text: str
    url: str


class Client:
    """A browser-less client with a cookie jar (the CSRF cookie)."""

    def __init__(self, base: str, server: DashboardServer | None = None) -> None:
        self.base = base
        self.server = server
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def _open(self, req: urllib.request.Request) -> Page:
        try:
            with self.opener.open(req, timeout=10) as r:
                return Page(r.status, r.read().decode(), r.url)
        except urllib.error.HTTPError as e:
            return Page(e.code, e.read().decode(), req.full_url)

    def get(self, path: str) -> Page:
        return self._open(urllib.request.Request(self.base + path))

    def post(self, path: str, form: dict[str, str], headers: dict[str, str] | None = None
             ) -> Page:
        data = urllib.parse.urlencode(form).encode()
        return self._open(urllib.request.Request(self.base + path, data=data,
                                                 headers=headers or {}, method="POST"))

    def csrf(self, path: str) -> str:
        """The CSRF field of the first action form on the page at ``path``."""
        m = re.search(r'name=csrf value="([0-9a-f.]+)"', self.get(path).text)
        assert m, f"no action form on {path}"
        return m.group(1)


@pytest.fixture
def serve() -> Iterator[object]:
    """``serve(app, token=...)`` starts a dashboard on a free port; all are
    stopped at the end of the test."""
    servers: list[DashboardServer] = []

    def start(app: object, token: str | None = None, **kw: object) -> Client:
        server = DashboardServer(app, port=0, token=token, **kw).start()  # type: ignore[arg-type]
        servers.append(server)
        return Client(server.url, server)

    yield start
    for s in servers:
        s.stop()  # a second stop does nothing
