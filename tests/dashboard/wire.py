"""Raw HTTP over sockets, for requests no well-behaved client library sends
(bad framing, half heads, floods) and for watching what the server does
with the connection afterwards."""

from __future__ import annotations

import re
import selectors
import socket
import time
import weakref
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int | None  # None: the server closed (or reset) without a response
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    closed: bool = False  # the server closed the connection after it


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    return parts.hostname, parts.port


def connect(url: str, *, source: str | None = None, timeout: float = 10.0) -> socket.socket:
    host, port = address(url)
    return socket.create_connection((host, port), timeout=timeout,
                                    source_address=(source, 0) if source else None)


_LEFT: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def read_reply(sock: socket.socket, timeout: float = 10.0, *, head_only: bool = False) -> Reply:
    """One response from ``sock`` (an interim 100 Continue skipped), and
    whether the server said it closes the connection after it.  Bytes of a
    next (pipelined) response are kept for the next call."""
    sock.settimeout(timeout)
    data = _LEFT.pop(sock, b"")

    def more() -> bool:
        nonlocal data
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return False
        data += chunk
        return bool(chunk)

    while True:
        while b"\r\n\r\n" not in data:
            if not more():
                return Reply(None, closed=True)
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        m = re.match(r"HTTP/1\.[01] (\d{3})", lines[0])
        assert m, lines[0]
        if m.group(1) != "100":
            break
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:])}
    length = 0 if head_only else int(headers.get("content-length", "0"))
    while len(data) < length and more():
        pass
    _LEFT[sock] = data[length:]
    closed = headers.get("connection", "").lower() == "close"
    return Reply(int(m.group(1)), headers, data[:length], closed)


def request(url: str, raw: bytes, *, timeout: float = 10.0, source: str | None = None
            ) -> Reply:
    """Send ``raw`` (leaving our side open) and read one response."""
    with connect(url, source=source, timeout=timeout) as sock:
        sock.sendall(raw)
        return read_reply(sock, timeout)


def waits_for_close(sock: socket.socket, within: float) -> float | None:
    """Seconds until the server ends the connection (EOF or reset, after any
    response bytes), or None if it is still open after ``within`` seconds."""
    start = time.monotonic()
    deadline = start + within
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
        except TimeoutError:
            return None
    return None


def closed_within(socks: list[socket.socket], within: float) -> list[socket.socket]:
    """Those of ``socks`` the server ends (EOF or reset, after any response
    bytes) within ``within`` seconds, watched all at once."""
    closed: list[socket.socket] = []
    deadline = time.monotonic() + within
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                sock = key.fileobj  # type: ignore[assignment]
                try:
                    sock.setblocking(False)
                    ended = not sock.recv(65536)
                except (ConnectionResetError, BrokenPipeError):
                    ended = True
                except BlockingIOError:
                    ended = False
                if ended:
                    sel.unregister(sock)
                    closed.append(sock)
    return closed


def get(path: str, host: str = "127.0.0.1", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


def post(path: str, form: bytes, host: str = "127.0.0.1", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            f"application/x-www-form-urlencoded\r\nContent-Length: {len(form)}\r\n{extra}\r\n"
            ).encode() + form
