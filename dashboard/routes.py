"""URL → view, and what the user sees when something goes wrong."""

from __future__ import annotations

import logging
from importlib import resources

from duebox.errors import DatabaseError, JobNotFoundError, ValidationError

# Imported for their @route registrations.
from . import actions, views_jobs, views_ops, views_overview  # noqa: F401
from .context import Dashboard
from .render import esc, page
from .web import ROUTES, HTTPError, Request, Response

log = logging.getLogger("duebox.dashboard")

_STATIC = {"dashboard.css": "text/css; charset=utf-8",
           "dashboard.js": "text/javascript; charset=utf-8"}


def _static(name: str) -> Response:
    if name not in _STATIC:
        raise HTTPError(404, f"no static file {name!r}")
    body = resources.files("duebox.dashboard").joinpath("static", name).read_bytes()
    return Response(body=body, content_type=_STATIC[name],
                    headers=[("Cache-Control", "max-age=300")])


def _error(status: int, message: str) -> Response:
    body = (f'<p class="notice bad">{esc(message)}</p>'
            '<p><a href="/">overview</a></p>')
    return Response(status, page("Refused" if status in (403, 429) else "Error", body))


def handle(d: Dashboard, request: Request) -> Response:
    """Run the view for ``request``; every failure becomes a page that says
    what was wrong (a bad field by name, a refusal and why)."""
    if request.method == "GET" and request.path.startswith("/static/"):
        try:
            return _static(request.path.removeprefix("/static/"))
        except HTTPError as exc:
            return _error(exc.status, exc.message)
    method = "GET" if request.method == "HEAD" else request.method
    if method not in ("GET", "POST"):
        return _error(405, f"method {request.method} is not allowed")
    try:
        for verb, pattern, view in ROUTES:
            m = pattern.fullmatch(request.path) if verb == method else None
            if m:
                return view(d, request, *m.groups())
        raise HTTPError(404, f"no page at {request.path}")
    except HTTPError as exc:
        return _error(exc.status, exc.message)
    except JobNotFoundError as exc:
        return _error(404, str(exc))
    except ValidationError as exc:
        return _error(400, f"{type(exc).__name__}: {exc}")
    except DatabaseError as exc:
        log.warning("dashboard: %s", exc)
        # Unreachable, or (PermissionDeniedError) the role may not do this.
        return _error(503, f"{type(exc).__name__}: {exc}")
