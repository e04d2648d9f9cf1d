"""The HTTP server: one event-loop thread for the connections, a bounded
pool of threads for the views.  Standard library only (asyncio).

The standard library's ``ThreadingHTTPServer`` (used before) gives every
connection a thread for as long as it lasts and reads without deadlines:
600 half-open connections held 600 threads.  Here:

* The event loop owns every socket; a connection waiting for a request head
  costs a few kilobytes, not a thread.  The head must come whole within
  ``head_timeout``, the body within ``body_timeout``, and the client must
  take the response within ``write_timeout``, or the connection is closed
  (:mod:`.http11`).  A kept-alive connection waits for its next head under
  the same deadline.
* At most ``max_connections``.  When full, the connection that has waited
  longest for a head is closed to make room: a slowloris attack evicts its
  own connections while a real client's head arrives within milliseconds.
  When no connection is waiting, the newcomer is answered 503 and closed.
* Views (database reads, actions) run on at most ``threads`` threads; a
  request waits at most ``queue_wait`` seconds for one, then gets 503.
* What the head decides is decided in the loop, before any body byte is
  read: framing (400/411/413), the Host allow-list (421, :mod:`.hosts`), and
  for an action the read-only, throttle and origin checks (403/429,
  :meth:`.Guard.before_body`).  Only then is an action's body read.  A
  response sent without reading a body closes the connection after a short
  lingering drain, so the client reads the response rather than a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from duebox import Duebox
from duebox.errors import ValidationError

from .gate import Gate, ViewPool, plain
from .hosts import listen
from .http11 import (
    CONTINUE,
    Head,
    ProtocolError,
    encode_response,
    read_body,
    read_head,
)
from .inputs import decode_form, decode_target
from .limits import Limits
from .web import HTTPError, Response

log = logging.getLogger("duebox.dashboard")

LINGER_SECONDS = 2.0  # drain what a client still sends after a response that closes
LINGER_BYTES = 256 * 1024


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    waiting_since: float | None  # since when it waits for a head; None while busy


class DashboardServer:
    """``DashboardServer(app, port=0).start()`` serves on a thread (tests);
    :meth:`serve_forever` in the foreground (``duebox dashboard``).  Binds in
    the constructor (OSError if it cannot)."""

    def __init__(self, app: Duebox, *, host: str = "127.0.0.1", port: int = 8377,
                 token: str | None = None, refresh: float = 2.0,
                 show_unregistered_payloads: bool = False, allow_hosts: Iterable[str] = (),
                 limits: Limits | None = None) -> None:
        self.gate = Gate(app, token=token, refresh=refresh,
                         show_unregistered_payloads=show_unregistered_payloads,
                         allow_hosts=allow_hosts, limits=limits)  # checked before binding
        self.dashboard = self.gate.dashboard
        self.limits = self.gate.limits
        self._socket = listen(host, port)
        self.gate.listening_on(self._socket.getsockname()[0])
        self._views = ViewPool(self.limits)
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def server_address(self) -> tuple[str, int]:
        host, port = self._socket.getsockname()[:2]
        return host, port

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    # --- running -------------------------------------------------------------------

    async def _serve(self, started: threading.Event | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        server = await asyncio.start_server(self._connection, sock=self._socket,
                                            limit=self.limits.max_head)
        if started is not None:
            started.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

    def serve_forever(self) -> None:
        """Serve until interrupted (KeyboardInterrupt) or :meth:`stop`."""
        asyncio.run(self._serve())

    def start(self) -> DashboardServer:
        started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve(started)),
                                        name="duebox-dashboard", daemon=True)
        self._thread.start()
        started.wait(30)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join()
        self.close()

    def close(self) -> None:
        self._socket.close()
        self._views.close()

    # --- one connection --------------------------------------------------------------

    def _admit(self, task: asyncio.Task[None], writer: asyncio.StreamWriter) -> bool:
        """Register a new connection, evicting the one that has waited longest
        for a request head when full; False when none can make room."""
        if len(self._connections) >= self.limits.max_connections:
            waiting = [(c.waiting_since, t) for t, c in self._connections.items()
                       if c.waiting_since is not None]
            if not waiting:
                return False
            _, oldest = min(waiting, key=lambda pair: pair[0])
            # Its read ends at once (EOF mid-head: nothing runs); its task then ends.
            self._connections.pop(oldest).writer.transport.abort()
        self._connections[task] = _Connection(writer, time.monotonic())
        return True

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if not self._admit(task, writer):
            writer.write(self._encode(plain(503, "too many connections; try again",
                                             [("Retry-After", "1")]), close=True))
            writer.close()
            return
        peer = writer.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else ""
        conn = self._connections[task]
        linger = False
        try:
            while True:
                conn.waiting_since = time.monotonic()
                head = await read_head(reader, self.limits.head_timeout)
                if head is None:
                    return
                conn.waiting_since = None
                response, unread = await self._exchange(reader, writer, head, client)
                keep = head.keep_alive and not unread and not self._stopping.is_set()
                await self._write(writer, response, head_only=head.method == "HEAD",
                                  close=not keep)
                if not keep:
                    linger = unread
                    return
        except ProtocolError as exc:
            log.debug("dashboard: %s: %s %s", client, exc.status, exc.message)
            linger = True
            with contextlib.suppress(ConnectionError, TimeoutError):
                await self._write(writer, plain(exc.status, exc.message), close=True)
        except (ConnectionError, TimeoutError):
            pass  # gone, or not reading what we send
        except asyncio.CancelledError:
            # The server stops.  Ending normally: asyncio 3.11 logs a connection
            # task that ends cancelled as an error.
            pass
        except Exception:
            log.exception("dashboard: connection from %s failed", client)
        finally:
            await self._close(reader, writer, conn, linger)
            self._connections.pop(task, None)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        head: Head, client: str) -> tuple[Response, bool]:
        """The response to one request head, and whether its body is left unread."""
        unread = head.length > 0
        # Until the path is decoded its refusals are judged by the raw one.
        path = head.target.partition("?")[0]
        try:
            path, query = decode_target(head.target)
            request = self.gate.admit(head.method, path, query, head.headers, client=client,
                                      length=head.length)
            if self.gate.reads_body(request):
                if head.expects_continue and unread:
                    writer.write(CONTINUE)
                request.form = decode_form(
                    await read_body(reader, head.length, self.limits.body_timeout))
                unread = False
        except (HTTPError, ValidationError) as exc:
            return self.gate.refuse(path, exc), unread
        return await self._views.run(self.gate, request), unread

    def _encode(self, response: Response, *, head_only: bool = False,
                close: bool = False) -> bytes:
        body = response.body.encode() if isinstance(response.body, str) else response.body
        return encode_response(response.status,
                               [("Content-Type", response.content_type), *response.headers],
                               body, head_only=head_only, close=close)

    async def _write(self, writer: asyncio.StreamWriter, response: Response, *,
                     head_only: bool = False, close: bool = False) -> None:
        writer.write(self._encode(response, head_only=head_only, close=close))
        async with asyncio.timeout(self.limits.write_timeout):
            await writer.drain()

    async def _close(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     conn: _Connection, linger: bool) -> None:
        """Close; first, when the client may still be sending (a body left
        unread), end our side and drain a little, so the client reads the
        response instead of a reset."""
        if linger and not writer.is_closing() and writer.can_write_eof():
            conn.waiting_since = time.monotonic()  # evictable while it lingers
            with contextlib.suppress(OSError, TimeoutError, asyncio.CancelledError):
                writer.write_eof()
                async with asyncio.timeout(LINGER_SECONDS):
                    drained = 0
                    while drained < LINGER_BYTES and (chunk := await reader.read(65536)):
                        drained += len(chunk)
        writer.close()


__all__ = ["DashboardServer", "Limits"]
