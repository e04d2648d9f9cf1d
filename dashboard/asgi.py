"""The dashboard as an ASGI app, to mount in a FastAPI or Starlette app
(``app.mount("/duebox", duebox.dashboard.asgi_app(jobs_app))``); see
docs/dashboard.md, "Mounting it in your app".

Each request passes the same checks as on the dashboard's own server
(duebox.dashboard.gate): the mount prefix (``root_path``) and the path
and query are checked, the ``Host`` allow-list, the body's size and, for
an action, the read-only, throttle and origin checks before the body is
read.  The views run on the dashboard's bounded pool of threads, never on
the event loop.  Deadlines for heads and bodies on the wire are the host
server's (uvicorn, hypercorn ...); the body of an action is read within
``limits.body_timeout`` and at most ``limits.max_body`` bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import unquote

from duebox import Duebox
from duebox.errors import ValidationError

from .gate import Gate, ViewPool, body_length
from .inputs import checked, checked_root, decode_form, decode_query
from .limits import Limits
from .web import HTTPError, Response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI's header pairs as the gate reads them: names in lower case,
    repeats joined (cookies with '; ')."""
    out: dict[str, str] = {}
    for name_b, value_b in raw:
        name, value = name_b.decode("latin-1").lower(), value_b.decode("latin-1")
        sep = "; " if name == "cookie" else ", "
        out[name] = f"{out[name]}{sep}{value}" if name in out else value
    return out


def _strict_path(scope: Scope) -> str:
    """The request's path decoded as strict UTF-8 from ``raw_path`` (the
    server's ``path`` may have replaced bad bytes with U+FFFD)."""
    raw = scope.get("raw_path")
    if not raw:
        return str(scope.get("path", ""))
    try:
        return unquote(bytes(raw).decode("ascii"), errors="strict")
    except UnicodeError:
        raise ValidationError("path", "must be percent-encoded UTF-8") from None


def route_path(scope: Scope, path: str | None = None) -> str:
    """The path below the mount prefix.  Starlette keeps the prefix in
    ``path`` and names it in ``root_path``; other servers strip it."""
    path = str(scope.get("path", "")) if path is None else path
    root = str(scope.get("root_path", ""))
    if root and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")):]
    return path or "/"


class DashboardASGI:
    """An ASGI 3 application: ``await app(scope, receive, send)``."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.limits = gate.limits
        self._views = ViewPool(gate.limits)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            response = await self._answer(scope, receive)
            await _send(send, response, head_only=scope.get("method") == "HEAD")
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """When served on its own (``uvicorn module:dashboard``)."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _answer(self, scope: Scope, receive: Receive) -> Response:
        path, root = route_path(scope), ""
        try:
            path = checked("path", route_path(scope, _strict_path(scope)))
            root = checked_root(str(scope.get("root_path", "")))
            headers = _headers(scope.get("headers", ()))
            client = scope.get("client") or ("",)
            request = self.gate.admit(
                str(scope["method"]), path,
                decode_query(bytes(scope.get("query_string", b"")).decode("latin-1")), headers,
                client=str(client[0]), length=body_length(headers.get("content-length")),
                root=root)
            if self.gate.reads_body(request):
                request.form = decode_form(await self._body(receive))
        except (HTTPError, ValidationError) as exc:
            return self.gate.refuse(path, exc, root)
        return await self._views.run(self.gate, request)

    async def _body(self, receive: Receive) -> bytes:
        """An action's body: at most ``max_body`` bytes (413 beyond, also
        without a Content-Length), whole within ``body_timeout`` (408)."""
        body = b""
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise HTTPError(400, "the client left in the middle of the body")
                    body += bytes(message.get("body", b""))
                    if len(body) > self.limits.max_body:
                        raise HTTPError(413, f"request body over {self.limits.max_body} bytes")
                    if not message.get("more_body", False):
                        return body
        except TimeoutError:
            raise HTTPError(408, f"request body not received within "
                                 f"{self.limits.body_timeout:g} s") from None

    def close(self) -> None:
        """Ends the views' threads (after those running)."""
        self._views.close()


async def _send(send: Send, response: Response, *, head_only: bool) -> None:
    body = response.body.encode() if isinstance(response.body, str) else response.body
    headers = [("content-type", response.content_type), *response.headers,
               ("content-length", str(len(body)))]
    await send({"type": "http.response.start", "status": response.status,
                "headers": [(n.lower().encode("latin-1"), v.encode("latin-1"))
                            for n, v in headers]})
    await send({"type": "http.response.body", "body": b"" if head_only else body})


def asgi_app(app: Duebox, *, token: str | None = None, refresh: float = 2.0,
             show_unregistered_payloads: bool = False, allow_hosts: Iterable[str] = (),
             limits: Limits | None = None) -> DashboardASGI:
    """The dashboard of ``app`` as an ASGI app to mount under a prefix.

    The options are ``duebox dashboard``'s: read-only unless ``token`` is
    given; ``allow_hosts`` the names it answers for besides ``localhost``
    and IP literals (the name your users type: other names get 421)."""
    return DashboardASGI(Gate(app, token=token, refresh=refresh,
                              show_unregistered_payloads=show_unregistered_payloads,
                              allow_hosts=allow_hosts, limits=limits))


__all__ = ["DashboardASGI", "asgi_app", "route_path"]
