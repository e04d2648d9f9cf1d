"""The HTTP server: the standard library's threading server, nothing to build.

Every response carries a Content-Security-Policy that allows this origin
only (no inline script, no external URL), and the CSRF cookie when the
browser has none yet.
"""

from __future__ import annotations

import logging
import threading
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from duebox import Duebox

from .context import Dashboard
from .routes import handle
from .security import Guard
from .web import Request, Response

log = logging.getLogger("duebox.dashboard")

MAX_FORM_BYTES = 64 * 1024
SECURITY_HEADERS = [
    ("Content-Security-Policy",
     "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
     "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),
]


def _cookies(header: str | None) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header or "")
    except CookieError:
        return {}
    return {k: m.value for k, m in jar.items()}


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _serve(self, method: str) -> None:
        parts = urlsplit(self.path)
        form: dict[str, str] = {}
        if method == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_FORM_BYTES:
                self._send(Response(413, b"form too large", "text/plain"))
                return
            form = dict(parse_qsl(self.rfile.read(length).decode("utf-8", "replace")))
        request = Request(method=method, path=parts.path or "/",
                          query=dict(parse_qsl(parts.query)), form=form,
                          cookies=_cookies(self.headers.get("Cookie")),
                          headers={k.lower(): v for k, v in self.headers.items()})
        dash = self.server.dashboard
        if not self.server.host_allowed(request.headers.get("host", "")):
            # DNS rebinding: a foreign site's name pointed at 127.0.0.1.
            self._send(Response(421, b"unexpected Host header", "text/plain"))
            return
        request.csrf_cookie, set_cookie = dash.guard.cookie(request)
        try:
            response = handle(dash, request)
        except Exception:
            log.exception("dashboard: %s %s failed", method, self.path)
            response = Response(500, b"internal error (see the dashboard's log)", "text/plain")
        if set_cookie:
            response.headers.append(("Set-Cookie", set_cookie))
        self._send(response, head=method == "HEAD")

    def _send(self, response: Response, head: bool = False) -> None:
        body = response.body.encode() if isinstance(response.body, str) else response.body
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in [*SECURITY_HEADERS, *response.headers]:
            self.send_header(name, value)
        if "Cache-Control" not in dict(response.headers):
            self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")


class DashboardServer(ThreadingHTTPServer):
    """``DashboardServer(app, port=0).start()`` serves on a thread (tests);
    :meth:`serve_forever` in the foreground (``duebox dashboard``)."""

    daemon_threads = True

    def __init__(self, app: Duebox, *, host: str = "127.0.0.1", port: int = 8377,
                 token: str | None = None, refresh: float = 2.0,
                 show_unregistered_payloads: bool = False) -> None:
        self.dashboard = Dashboard(app, Guard(token), refresh=refresh,
                                   show_unregistered_payloads=show_unregistered_payloads)
        super().__init__((host, port), _Handler)
        self._loopback = host in ("127.0.0.1", "localhost", "::1")
        self._thread: threading.Thread | None = None

    def host_allowed(self, host_header: str) -> bool:
        """On a loopback address only loopback names may be asked for (a
        page elsewhere cannot rebind its own name to this server); on any
        other address the proxy in front decides."""
        if not self._loopback:
            return True
        name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
        return name in ("127.0.0.1", "localhost", "[::1]")

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> DashboardServer:
        self._thread = threading.Thread(target=self.serve_forever, name="duebox-dashboard",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()
