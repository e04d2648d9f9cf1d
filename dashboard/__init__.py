"""``duebox dashboard``: a small web app over the outbox (docs/dashboard.md).

Read-only unless started with an operator token; every page is a bounded,
index-backed read.  Standard library HTTP server, server-rendered HTML and
SVG, one small script for auto-refresh: nothing to build, nothing fetched
from elsewhere.
"""

from __future__ import annotations

from .server import DashboardServer

__all__ = ["DashboardServer"]
