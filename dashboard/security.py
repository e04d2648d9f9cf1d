"""Who may change things: the operator token, CSRF, and caps on actions and
on failed authentication.

The dashboard is read-only unless it was started with a token.  A mutating
request must then carry, in its form: the token, an operator name and a
reason (both land in the audit table), and a CSRF field bound to a cookie of
this browser (a double-submit cookie, signed with this server's secret, so a
page on another site can neither read nor forge it).  The field carries the
time it was issued under the same signature and is refused once older than
``csrf_max_age`` (reload the page for a fresh one).

Before the body of a mutating request is even read (:meth:`Guard.before_body`)
it is refused if the dashboard is read-only, if the client is throttled for
failed authentication (429, :mod:`.throttle`), or if it comes from another
site: an ``Origin`` that is not this dashboard (``null`` included: sandboxed
frames and some redirects send it) or ``Sec-Fetch-Site`` other than
``same-origin``.  This dashboard is ``http://`` and the ``Host`` the request
names, port included; ``https://`` only under a name given with
``--allow-host``, where a reverse proxy may serve it over TLS.  Browsers
send one or both with every form POST; a request with neither (curl,
scripts) is judged by its CSRF field and token alone.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from duebox.errors import ValidationError
from duebox.validation import check_operator

from .hosts import host_name
from .throttle import Throttle
from .web import HTTPError, Request

CSRF_COOKIE = "duebox_csrf"
CSRF_MAX_AGE = 2 * 3600.0  # seconds a form stays usable
_CLOCK_SLACK = 60.0  # a field "from the future" by less than this is the clock stepping


class Guard:
    def __init__(self, token: str | None, *, secret: bytes | None = None,
                 actions_per_minute: int = 30, csrf_max_age: float = CSRF_MAX_AGE,
                 clock: Callable[[], float] = time.time,
                 proxied: Iterable[str] = ()) -> None:
        if token is not None and len(token) < 8:
            raise ValidationError("token", "must be at least 8 characters", "***")
        self.token = token
        self._secret = secret or secrets.token_bytes(32)
        self._limit = actions_per_minute
        self._recent: deque[float] = deque()
        self._lock = threading.Lock()
        self._clock = clock
        self.csrf_max_age = csrf_max_age
        self.throttle = Throttle(clock)
        # Names a reverse proxy forwards (--allow-host, checked): the only
        # ones a page may reach this dashboard at over https://.
        self._proxied = frozenset(proxied)

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
        # Under a mount, only the dashboard's own paths get it (the prefix is
        # checked: letters, digits and -._~ between slashes).
        return value, f"{CSRF_COOKIE}={value}; Path={request.root}/; HttpOnly; SameSite=Strict"

    def _sign(self, cookie: str, issued: str) -> str:
        return hmac.new(self._secret, f"{cookie}.{issued}".encode(), hashlib.sha256).hexdigest()

    def csrf_field(self, cookie: str) -> str:
        """``<issued at>.<HMAC of cookie and issued at>``."""
        issued = str(int(self._clock()))
        return f"{issued}.{self._sign(cookie, issued)}"

    def _csrf_refusal(self, cookie: str, sent: str) -> str | None:
        issued, _, mac = sent.partition(".")
        if not cookie or not issued.isdigit() or len(issued) > 12 or not hmac.compare_digest(
                mac.encode(), self._sign(cookie, issued).encode()):
            return "refused: missing or wrong CSRF field (reload the page)"
        age = self._clock() - int(issued)
        if not -_CLOCK_SLACK <= age <= self.csrf_max_age:
            return (f"refused: the form has expired (older than {self.csrf_max_age / 60:g} "
                    "min): reload the page")
        return None

    def before_body(self, request: Request) -> None:
        """Refuse a mutating request on what its head says (raises
        :class:`HTTPError`); cheap, so it runs before the body is read."""
        if self.token is None:
            raise HTTPError(403, "refused: this dashboard is read-only (start it with --token "
                                 "or DUEBOX_DASHBOARD_TOKEN to allow actions)")
        wait = self.throttle.retry_after(request.client)
        if wait is not None:
            raise HTTPError(429, f"refused: too many failed attempts; try again in {wait} s",
                            headers=[("Retry-After", str(wait))])
        origin = request.headers.get("origin")
        if origin is not None and not _same_origin(origin, request.headers.get("host", ""),
                                                   self._proxied):
            raise HTTPError(403, f"refused: cross-site request from {origin}")
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            raise HTTPError(403, f"refused: cross-site request ({site})")

    def authorize(self, request: Request) -> tuple[str, str]:
        """Check a mutating request; returns (operator, reason) or raises
        :class:`HTTPError` saying why it is refused."""
        self.before_body(request)
        token = self.token
        assert token is not None  # before_body refused a read-only dashboard
        refusal = self._csrf_refusal(request.cookies.get(CSRF_COOKIE, ""),
                                     request.form.get("csrf", ""))
        if refusal is None and not hmac.compare_digest(
                request.form.get("token", "").encode(), token.encode()):
            refusal = "refused: wrong or missing operator token"
        if refusal is not None:
            self.throttle.failed(request.client)
            raise HTTPError(403, refusal)
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
                raise HTTPError(429, f"refused: more than {self._limit} actions in a minute",
                                headers=[("Retry-After",
                                          str(max(1, int(61 - (now - self._recent[0])))))])
            self._recent.append(now)


def _same_origin(origin: str, host: str, proxied: frozenset[str]) -> bool:
    """``Origin`` names this dashboard as the browser reached it: its
    scheme, host and port (``null``, another scheme, host or port, or a
    malformed value do not).  It serves ``http://``; ``https://`` only under
    a name in ``proxied``, where a reverse proxy may add TLS."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    schemes = ("http", "https") if host_name(host) in proxied else ("http",)
    return (parts.scheme in schemes and bool(host)
            and parts.netloc.lower() == host.strip().lower()
            and origin.lower() == f"{parts.scheme}://{parts.netloc}".lower())
