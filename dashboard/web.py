"""The request and response the dashboard's views see, free of the server
that carries them (duebox.dashboard.server), so views are plain functions."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar


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


def redirect(location: str) -> Response:
    return Response(303, b"", headers=[("Location", location)])


V = TypeVar("V", bound=Callable[..., Response])
# (method, path pattern, view), filled by @route where the views are defined;
# a view gets the pattern's groups as arguments after (dashboard, request).
ROUTES: list[tuple[str, re.Pattern[str], Callable[..., Response]]] = []
ID = r"([0-9a-fA-F-]{32,36})"  # a job id in a path
REF = r"([^/]{1,200})"  # an id or a name in a path


def find_route(method: str, path: str) -> tuple[Callable[..., Response], tuple[str, ...]] | None:
    """The view for ``method`` and ``path``, and the path's groups."""
    for verb, pattern, view in ROUTES:
        m = pattern.fullmatch(path) if verb == method else None
        if m:
            return view, m.groups()
    return None


def route(method: str, path: str) -> Callable[[V], V]:
    def register(view: V) -> V:
        ROUTES.append((method, re.compile(path), view))
        return view

    return register


__all__ = ["ID", "REF", "ROUTES", "HTTPError", "Request", "Response", "find_route", "redirect",
           "route"]
