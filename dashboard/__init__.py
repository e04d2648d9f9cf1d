"""``duebox dashboard``: a small web app over the outbox (docs/dashboard.md).

Read-only unless started with an operator token; every page is a bounded,
index-backed read, also as JSON (``/api/...``).  Served by its own server
(:class:`DashboardServer`, ``duebox dashboard``) or mounted under a prefix
in another web app: :func:`asgi_app` (FastAPI, Starlette), :func:`wsgi_app`
(Flask, Django).  Standard library HTTP server, server-rendered HTML and
SVG, one small script for auto-refresh: nothing to build, nothing fetched
from elsewhere.
"""

from __future__ import annotations

from .asgi import asgi_app
from .limits import Limits
from .server import DashboardServer
from .wsgi import wsgi_app

__all__ = ["DashboardServer", "Limits", "asgi_app", "wsgi_app"]
