"""The checks every request passes before a view runs, whatever carries it:
the dashboard's own server (duebox.dashboard.server) and the ASGI and
WSGI apps another web app mounts (duebox.dashboard.mounts).

One order for all: the ``Host`` allow-list (421, DNS rebinding), the size
of a body (413), then, for an action, the read-only, throttle and origin
checks (:meth:`.Guard.before_body`); only then does the transport read the
body, and :func:`.routes.respond` runs the view.  Views run on a bounded
pool of threads (:class:`ViewPool`) where the transport is asynchronous.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from http.cookies import CookieError, SimpleCookie

from duebox import Duebox
from duebox.errors import ValidationError

from .context import Dashboard
from .hosts import HostAllowList, checked_name
from .limits import Limits
from .routes import bad_request, refusal, respond, secured, wants_body
from .security import Guard
from .web import HTTPError, Request, Response, mounted_at

_DIGITS = re.compile(r"[0-9]{1,18}")


def _cookies(header: str | None) -> dict[str, str]:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header or "")
    except CookieError:
        return {}
    return {k: m.value for k, m in jar.items()}


def plain(status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> Response:
    """A refusal before any request could be read (busy, too many connections)."""
    return secured(Response(status, f"{message}\n".encode(), "text/plain; charset=utf-8",
                            headers=list(headers)))


def body_length(value: str | None) -> int:
    """A mount's ``Content-Length`` (0 when absent); 400 unless digits."""
    if value is None or value == "":
        return 0
    if not _DIGITS.fullmatch(value.strip()):
        raise HTTPError(400, "Content-Length must be one non-negative whole number")
    return int(value)


class Gate:
    def __init__(self, app: Duebox, *, token: str | None, refresh: float,
                 show_unregistered_payloads: bool, allow_hosts: Iterable[str],
                 limits: Limits | None) -> None:
        names = [checked_name(n) for n in allow_hosts]  # refused before anything starts
        guard = Guard(token, clock=lambda: app.clock.now().timestamp(), proxied=names)
        self.dashboard = Dashboard(app, guard, refresh=refresh,
                                   show_unregistered_payloads=show_unregistered_payloads)
        self.names = names
        self.limits = limits or Limits()
        # Until the transport knows its address: any IP literal (one cannot
        # be rebound), localhost and the names allowed.
        self.hosts = HostAllowList("0.0.0.0", names)

    def admit(self, method: str, path: str, query: dict[str, str], headers: Mapping[str, str],
              *, client: str, length: int, root: str = "") -> Request:
        """The request a head describes, or HTTPError / ValidationError
        saying why it is refused; ``path`` and ``query`` are checked
        (duebox.dashboard.inputs), ``root`` too."""
        if not self.hosts.allows(headers.get("host", "")):
            raise HTTPError(421, "unexpected Host header (allow the name with --allow-host, or "
                                 "allow_hosts= where the dashboard is mounted)")
        if length > self.limits.max_body:
            raise HTTPError(413, f"request body over {self.limits.max_body} bytes")
        request = Request(method=method, path=path or "/", query=query,
                          cookies=_cookies(headers.get("cookie")), headers=headers,
                          client=client, root=root)
        if self.reads_body(request):
            self.dashboard.guard.before_body(request)
        return request

    def listening_on(self, address: str) -> None:
        """The address the dashboard's own server is bound to: its IP
        literal is answered (and any, when it is 0.0.0.0 or ::)."""
        self.hosts = HostAllowList(address, self.names)

    @staticmethod
    def reads_body(request: Request) -> bool:
        return wants_body(request.method, request.path)

    def refuse(self, path: str, exc: HTTPError | ValidationError, root: str = "") -> Response:
        """The answer to a request refused before its view; links lead
        under ``root`` (checked, or '' when it is what was refused)."""
        with mounted_at(root):
            if isinstance(exc, ValidationError):
                return secured(bad_request(path, exc))
            return secured(refusal(path, exc.status, exc.message, exc.headers))

    def respond(self, request: Request) -> Response:
        return respond(self.dashboard, request)


class ViewPool:
    """Views (database reads, actions) on at most ``limits.threads``
    threads; a request waits at most ``limits.queue_wait`` seconds for one,
    then gets 503."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(limits.threads, thread_name_prefix="duebox-dashboard")
        # One semaphore per event loop (a mounted app may be driven by more
        # than one, as test clients do); each bounds what waits for a thread.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
            weakref.WeakKeyDictionary()

    async def run(self, gate: Gate, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.limits.threads))
        try:
            async with asyncio.timeout(self.limits.queue_wait):
                await slots.acquire()
        except TimeoutError:
            return plain(503, "busy: every dashboard thread is taken; try again",
                         [("Retry-After", "1")])
        try:
            return await loop.run_in_executor(self._pool, gate.respond, request)
        finally:
            slots.release()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
