"""The request and response the dashboard's views see, free of the server
that carries them (duebox.dashboard.server), so views are plain functions."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)
    form: dict[str, str] = field(default_factory=dict)
    cookies: dict[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case
    # This browser's CSRF cookie (set by the router before a view runs).
    csrf_cookie: str = ""
    client: str = ""  # the peer's address (throttling counts by it)
    # The prefix the dashboard is mounted under in another app ("/duebox";
    # "" on its own server), checked (duebox.dashboard.inputs.checked_root):
    # ``path`` is what follows it, and every link leads back under it.
    root: str = ""

    def arg(self, name: str) -> str:
        """A query or form field, stripped ('' when absent)."""
        return (self.form.get(name) or self.query.get(name) or "").strip()

    @property
    def partial(self) -> bool:
        """The auto-refresh script asks for the live part of a page only."""
        return self.headers.get("x-duebox-partial") == "1"


@dataclass
class Response:
    status: int = 200
    body: str | bytes = b""
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


class HTTPError(Exception):
    """Ends a request with ``status`` and a message shown to the user."""

    def __init__(self, status: int, message: str,
                 headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


# The mount prefix of the request being answered, for the links a page
# holds: views and render helpers name dashboard paths ("/jobs/ID") and
# url() puts them under the prefix.  Set around each response by
# mounted_at (duebox.dashboard.routes), on the thread that builds it.
_ROOT: ContextVar[str] = ContextVar("duebox_dashboard_root", default="")


@contextmanager
def mounted_at(root: str) -> Iterator[None]:
    token = _ROOT.set(root)
    try:
        yield
    finally:
        _ROOT.reset(token)


def url(path: str) -> str:
    """A dashboard path ("/jobs") as a link: under the mount prefix."""
    return _ROOT.get() + path


def redirect(location: str) -> Response:
    """303 to a dashboard path (under the mount prefix)."""
    return Response(303, b"", headers=[("Location", url(location))])


def _json_value(value: Any) -> Any:
    """What json.dumps cannot write itself: times as ISO 8601, ids as text,
    read models (dataclasses) as objects."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID | enum.Enum):
        return str(value.value if isinstance(value, enum.Enum) else value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def json_response(data: Any, status: int = 200, headers: list[tuple[str, str]] | None = None
                  ) -> Response:
    body = json.dumps(data, default=_json_value, sort_keys=True, allow_nan=False)
    return Response(status, body.encode(), "application/json", headers=list(headers or []))


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    view: Callable[..., Response]
    # The query fields a JSON view reads: any other is refused (400 naming
    # it), so a misspelt filter is not silently a query for everything.
    # None: an HTML page, which ignores what it does not read.
    params: frozenset[str] | None = None


V = TypeVar("V", bound=Callable[..., Response])
# Filled by @route where the views are defined; a view gets the pattern's
# groups as arguments after (dashboard, request).
ROUTES: list[Route] = []
ID = r"([0-9a-fA-F-]{32,36})"  # a job id in a path
REF = r"([^/]{1,200})"  # an id or a name in a path


def find_route(method: str, path: str) -> tuple[Route, tuple[str, ...]] | None:
    """The route for ``method`` and ``path``, and the path's groups."""
    for r in ROUTES:
        m = r.pattern.fullmatch(path) if r.method == method else None
        if m:
            return r, m.groups()
    return None


def methods_at(path: str) -> list[str]:
    """The methods some route serves at ``path`` (for a 405's Allow)."""
    found = {r.method for r in ROUTES if r.pattern.fullmatch(path)}
    if "GET" in found:
        found.add("HEAD")
    return sorted(found)


def route(method: str, path: str, *, params: tuple[str, ...] | None = None
          ) -> Callable[[V], V]:
    def register(view: V) -> V:
        ROUTES.append(Route(method, re.compile(path), view,
                            None if params is None else frozenset(params)))
        return view

    return register


__all__ = ["ID", "REF", "ROUTES", "HTTPError", "Request", "Response", "Route", "find_route",
           "json_response", "methods_at", "mounted_at", "redirect", "route", "url"]
