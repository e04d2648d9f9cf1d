"""Who may change things: the operator token, CSRF, and a cap on actions.

The dashboard is read-only unless it was started with a token.  A mutating
request must then carry, in its form: the token, an operator name and a
reason (both land in the audit table), and a CSRF field bound to a cookie of
this browser (a double-submit cookie, signed with this server's secret, so a
page on another site can neither read nor forge it); a request whose Origin
is another site is refused before anything else is looked at.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import deque

from duebox.dlq import check_operator
from duebox.errors import ValidationError

from .web import HTTPError, Request

CSRF_COOKIE = "duebox_csrf"


class Guard:
    def __init__(self, token: str | None, *, secret: bytes | None = None,
                 actions_per_minute: int = 30) -> None:
        if token is not None and len(token) < 8:
            raise ValidationError("token", "must be at least 8 characters", "***")
        self.token = token
        self._secret = secret or secrets.token_bytes(32)
        self._limit = actions_per_minute
        self._recent: deque[float] = deque()
        self._lock = threading.Lock()

    @property
    def read_only(self) -> bool:
        return self.token is None

    def cookie(self, request: Request) -> tuple[str, str | None]:
        """This browser's CSRF cookie value, and a Set-Cookie header when it
        has none yet."""
        value = request.cookies.get(CSRF_COOKIE, "")
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
            return value, None
        value = secrets.token_hex(32)
        return value, f"{CSRF_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict"

    def csrf_field(self, cookie: str) -> str:
        return hmac.new(self._secret, cookie.encode(), hashlib.sha256).hexdigest()

    def authorize(self, request: Request) -> tuple[str, str]:
        """Check a mutating request; returns (operator, reason) or raises
        :class:`HTTPError` saying why it is refused."""
        if self.token is None:
            raise HTTPError(403, "refused: this dashboard is read-only (start it with --token "
                                 "or DUEBOX_DASHBOARD_TOKEN to allow actions)")
        origin = request.headers.get("origin")
        host = request.headers.get("host", "")
        if origin and origin != "null" and origin.split("://", 1)[-1] != host:
            raise HTTPError(403, f"refused: cross-site request from {origin}")
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = request.form.get("csrf", "")
        if not cookie or not hmac.compare_digest(sent, self.csrf_field(cookie)):
            raise HTTPError(403, "refused: missing or stale CSRF field (reload the page)")
        if not hmac.compare_digest(request.form.get("token", "").encode(),
                                   self.token.encode()):
            raise HTTPError(403, "refused: wrong or missing operator token")
        try:
            operator, reason = check_operator(request.form.get("operator"),
                                              request.form.get("reason"))
        except ValidationError as exc:
            raise HTTPError(400, f"refused: {exc}") from None
        self._count_action()
        return operator, reason

    def _count_action(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._recent and now - self._recent[0] > 60:
                self._recent.popleft()
            if len(self._recent) >= self._limit:
                raise HTTPError(429, f"refused: more than {self._limit} actions in a minute")
            self._recent.append(now)
