"""What one request may cost the dashboard (docs/dashboard.md, "Hostile
clients"): its own server (duebox.dashboard.server) enforces them all; a
mount (duebox.dashboard.mounts) those its host server does not (the body of
an action, the threads the views run on)."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field


def _default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 512 if soft == resource.RLIM_INFINITY else max(16, min(512, soft // 2))


@dataclass(frozen=True)
class Limits:
    head_timeout: float = 10.0  # seconds for a whole request head (also idle keep-alive)
    body_timeout: float = 10.0
    write_timeout: float = 10.0
    max_head: int = 16 * 1024  # bytes of request line and headers
    max_body: int = 32 * 1024  # bytes of an action's form
    threads: int = 8  # views running at once
    queue_wait: float = 5.0  # seconds a request waits for a thread before 503
    max_connections: int = field(default_factory=_default_max_connections)
