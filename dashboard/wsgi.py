"""The dashboard as a WSGI app, to mount in a Flask or Django app under a
prefix (werkzeug's ``DispatcherMiddleware``, which sets ``SCRIPT_NAME``);
see docs/dashboard.md, "Mounting it in your app".

Each request passes the same checks as on the dashboard's own server
(duebox.dashboard.gate): the mount prefix (``SCRIPT_NAME``), the path and
query, the ``Host`` allow-list, the body's size and, for an action, the
read-only, throttle and origin checks before the body is read.  The view
runs on the WSGI server's thread (WSGI is synchronous); deadlines on the
wire are the server's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from duebox import Duebox
from duebox.errors import ValidationError

from .gate import Gate, body_length
from .http11 import status_text
from .inputs import checked, checked_root, decode_form, decode_query
from .limits import Limits
from .web import HTTPError, Response

StartResponse = Callable[..., Any]


def _text(environ: Mapping[str, Any], key: str, field: str) -> str:
    """``SCRIPT_NAME`` or ``PATH_INFO``: bytes carried as latin-1 (PEP 3333),
    decoded here as the UTF-8 they are, or refused naming ``field``."""
    try:
        return str(environ.get(key, "")).encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise ValidationError(field, "must be percent-encoded UTF-8") from None


def _headers(environ: Mapping[str, Any]) -> dict[str, str]:
    out = {key[5:].lower().replace("_", "-"): str(value) for key, value in environ.items()
           if key.startswith("HTTP_")}
    for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(key):
            out[key.lower().replace("_", "-")] = str(environ[key])
    return out


class DashboardWSGI:
    """A WSGI application: ``app(environ, start_response)``."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.limits = gate.limits

    def __call__(self, environ: dict[str, Any], start_response: StartResponse
                 ) -> Iterable[bytes]:
        response = self._answer(environ)
        body = response.body.encode() if isinstance(response.body, str) else response.body
        start_response(status_text(response.status),
                       [("Content-Type", response.content_type), *response.headers,
                        ("Content-Length", str(len(body)))])
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]

    def _answer(self, environ: dict[str, Any]) -> Response:
        # Until they are decoded, refusals are judged by the raw path, and
        # lead to the root of the host app.
        path, root = str(environ.get("PATH_INFO", "")) or "/", ""
        try:
            path = _text(environ, "PATH_INFO", "path") or "/"
            root = checked_root(_text(environ, "SCRIPT_NAME", "mount prefix"))
            headers = _headers(environ)
            length = body_length(headers.get("content-length"))
            request = self.gate.admit(
                str(environ.get("REQUEST_METHOD", "GET")), checked("path", path),
                decode_query(str(environ.get("QUERY_STRING", ""))), headers,
                client=str(environ.get("REMOTE_ADDR", "")), length=length, root=root)
            if self.gate.reads_body(request):
                body = environ["wsgi.input"].read(length) if length else b""
                request.form = decode_form(body)
        except (HTTPError, ValidationError) as exc:
            return self.gate.refuse(path, exc, root)
        return self.gate.respond(request)


def wsgi_app(app: Duebox, *, token: str | None = None, refresh: float = 2.0,
             show_unregistered_payloads: bool = False, allow_hosts: Iterable[str] = (),
             limits: Limits | None = None) -> DashboardWSGI:
    """The dashboard of ``app`` as a WSGI app to mount under a prefix; the
    options are :func:`duebox.dashboard.asgi_app`'s."""
    return DashboardWSGI(Gate(app, token=token, refresh=refresh,
                              show_unregistered_payloads=show_unregistered_payloads,
                              allow_hosts=allow_hosts, limits=limits))


__all__ = ["DashboardWSGI", "wsgi_app"]
