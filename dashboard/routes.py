"""URL → view, and what the user sees when something goes wrong.

:func:`respond` is the whole application as the server sees it: a checked
:class:`Request` in, a :class:`Response` with the security headers out.
Every response allows this origin only (no inline script, no external URL)
and carries the CSRF cookie when the browser has none yet.  A refusal is
a page for the HTML pages and a JSON object for the JSON API (``/api/``,
``/healthz``): :func:`refusal`.
"""

from __future__ import annotations

import logging
from importlib import resources

from sqlalchemy import exc as sa_exc

from duebox.errors import DatabaseError, JobNotFoundError, ValidationError

# Imported for their @route registrations.
from . import actions, api, views_jobs, views_ops, views_overview  # noqa: F401
from .context import Dashboard
from .render import esc, page
from .web import (
    HTTPError,
    Request,
    Response,
    find_route,
    json_response,
    methods_at,
    mounted_at,
    url,
)

log = logging.getLogger("duebox.dashboard")

_STATIC = {"dashboard.css": "text/css; charset=utf-8",
           "dashboard.js": "text/javascript; charset=utf-8"}
SECURITY_HEADERS = [
    ("Content-Security-Policy",
     "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
     "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),
]


def _static(name: str) -> Response:
    if name not in _STATIC:
        raise HTTPError(404, f"no static file {name!r}")
    body = resources.files("duebox.dashboard").joinpath("static", name).read_bytes()
    return Response(body=body, content_type=_STATIC[name],
                    headers=[("Cache-Control", "max-age=300")])


def error_page(status: int, message: str, headers: list[tuple[str, str]] | None = None
               ) -> Response:
    body = (f'<p class="notice bad">{esc(message)}</p>'
            f'<p><a href="{esc(url("/"))}">overview</a></p>')
    return Response(status, page("Refused" if status in (403, 429) else "Error", body),
                    headers=list(headers or []))


def secured(response: Response) -> Response:
    """``response`` with the security headers (and no caching unless it says)."""
    response.headers[:0] = SECURITY_HEADERS
    if not any(name == "Cache-Control" for name, _ in response.headers):
        response.headers.append(("Cache-Control", "no-store"))
    return response


def is_api(path: str) -> bool:
    """Whether ``path`` is the JSON API's (its refusals are JSON too)."""
    return path == "/healthz" or path == "/api" or path.startswith("/api/")


def refusal(path: str, status: int, message: str, headers: list[tuple[str, str]] | None = None,
            field: str | None = None) -> Response:
    """What a refused request gets: a page, or under the JSON API an object
    ``{"error": {"status", "message", "field"}}`` (``field``: the query
    field or path part at fault, when one is)."""
    if is_api(path):
        return json_response({"error": {"status": status, "message": message, "field": field}},
                             status, headers)
    return error_page(status, message, headers)


def bad_request(path: str, exc: ValidationError) -> Response:
    return refusal(path, 400, f"{type(exc).__name__}: {exc}", field=exc.field)


def wants_body(method: str, path: str) -> bool:
    """Whether a request is one whose body a view reads (an action)."""
    return method == "POST" and find_route("POST", path) is not None


def _unknown_fields(request: Request, params: frozenset[str]) -> None:
    unknown = sorted(set(request.query) - params)
    if unknown:
        takes = ", ".join(sorted(params)) or "none"
        raise ValidationError(unknown[0], f"is not a query field of {request.path} "
                                          f"(it takes: {takes})")


def handle(d: Dashboard, request: Request) -> Response:
    """Run the view for ``request``; every failure becomes a page (or a JSON
    object) that says what was wrong (a bad field by name, a refusal and
    why)."""
    path = request.path
    if request.method == "GET" and path.startswith("/static/"):
        try:
            return _static(path.removeprefix("/static/"))
        except HTTPError as exc:
            return error_page(exc.status, exc.message)
    method = "GET" if request.method == "HEAD" else request.method
    try:
        found = find_route(method, path)
        if found is None:
            allowed = methods_at(path)
            if allowed:
                raise HTTPError(405, f"method {request.method} is not allowed at {path}",
                                [("Allow", ", ".join(allowed))])
            raise HTTPError(404, f"no page at {path}")
        route, groups = found
        if route.params is not None:
            _unknown_fields(request, route.params)
        return route.view(d, request, *groups)
    except HTTPError as exc:
        return refusal(path, exc.status, exc.message, exc.headers)
    except JobNotFoundError as exc:
        return refusal(path, 404, str(exc))
    except ValidationError as exc:
        return bad_request(path, exc)
    except DatabaseError as exc:
        log.warning("dashboard: %s", exc)
        # Unreachable, or (PermissionDeniedError) the role may not do this.
        return refusal(path, 503, f"{type(exc).__name__}: {exc}")
    except sa_exc.DataError as exc:
        # A value the database refuses that inputs.py let through: still the
        # request's fault, said in one line (and worth a stricter check).
        log.warning("dashboard: %s %s: the database refused a value: %s", request.method,
                    path, str(exc.orig).strip().splitlines()[0])
        return refusal(path, 400, "the database refused a value in this request")


def respond(d: Dashboard, request: Request) -> Response:
    """The response to a checked request, as it goes on the wire."""
    request.csrf_cookie, set_cookie = d.guard.cookie(request)
    with mounted_at(request.root):
        try:
            response = handle(d, request)
        except Exception:
            log.exception("dashboard: %s %s failed", request.method, request.path)
            response = refusal(request.path, 500, "internal error (see the dashboard's log)")
    if set_cookie:
        response.headers.append(("Set-Cookie", set_cookie))
    return secured(response)
