"""The dashboard's HTTP/1.1 wire: read one request head under limits, frame
its body, write one response.  No dashboard knowledge lives here.

A deliberately small subset of HTTP/1.1 (GET, HEAD and POST with a
``Content-Length`` body), strict where a looser reading could misframe the
next request on a kept-alive connection.  Every refusal happens before a
body byte is read, so a hostile client costs at most one request head of
memory and one head deadline of a connection slot:

* The head (request line and headers) must fit in ``max_bytes`` (431) and
  arrive whole within a deadline counted from the moment it is awaited: a
  head drip-fed a byte at a time is cut off all the same (408).  A client
  that closes mid-head has sent no request (a half head is never run).
* Lines end in CRLF; no control character (NUL, a bare CR or LF, ESC ...)
  in the request line or a header; no space before a header's colon; no
  continuation lines; one Host (400).  The target is origin-form ASCII
  (``/path?query``).
* ``Content-Length`` is digits only, and repeats must agree (400).  Any
  ``Transfer-Encoding`` is refused (411: send a Content-Length): the forms
  here are small and browsers send a length.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from http import HTTPStatus

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"/[\x21-\x7e]*")  # origin-form, visible ASCII only
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # no CTL but tab
_DIGITS = re.compile(r"[0-9]+")
_HUGE = 10**18  # stands for any longer run of digits: over every limit
MAX_HEADERS = 100


class ProtocolError(Exception):
    """A request that cannot be framed: answered with ``status`` and the
    connection closed (what follows on it cannot be trusted)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Head:
    method: str
    target: str
    version: tuple[int, int]
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    length: int = 0  # Content-Length (0 when absent)

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        return self.version >= (1, 1) and "close" not in tokens

    @property
    def expects_continue(self) -> bool:
        return self.headers.get("expect", "").lower() == "100-continue"


def _header(line: bytes) -> tuple[str, str]:
    name, colon, value = line.partition(b":")
    if not colon or not _TOKEN.fullmatch(name):
        # Also a space before the colon, or a continuation line (RFC 9112 5.1, 5.2).
        raise ProtocolError(400, "malformed header line")
    value = value.strip(b" \t")
    if not _FIELD_VALUE.fullmatch(value):
        raise ProtocolError(400, f"control character in header {name.decode()!r}")
    return name.decode().lower(), value.decode("latin-1")


def _content_length(values: list[str]) -> int:
    found = {v.strip() for joined in values for v in joined.split(",")}
    if len(found) != 1 or not _DIGITS.fullmatch(next(iter(found))):
        raise ProtocolError(400, "Content-Length must be one non-negative whole number")
    value = found.pop()
    return int(value) if len(value) < 18 else _HUGE


def parse_head(raw: bytes) -> Head:
    """A request head (without its final blank line) → :class:`Head`, or
    :class:`ProtocolError` saying what is wrong with it."""
    request_line, *lines = raw.lstrip(b"\r\n").split(b"\r\n")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]):
        raise ProtocolError(400, "malformed request line")
    method, target, version = parts
    v = _VERSION.fullmatch(version)
    if v is None:
        raise ProtocolError(400, "malformed HTTP version")
    if v.group(1) != b"1":
        raise ProtocolError(505, "only HTTP/1.0 and HTTP/1.1 are served")
    if not _TARGET.fullmatch(target):
        raise ProtocolError(400, "the request target must be a path (ASCII, percent-encoded)")
    if len(lines) > MAX_HEADERS:
        raise ProtocolError(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    lengths: list[str] = []
    for line in lines:
        name, value = _header(line)
        if name == "content-length":
            lengths.append(value)
        if name == "host" and name in headers:
            raise ProtocolError(400, "more than one Host header")
        sep = "; " if name == "cookie" else ", "
        headers[name] = f"{headers[name]}{sep}{value}" if name in headers else value
    head = Head(method.decode(), target.decode(), (1, int(v.group(2))), headers)
    if "transfer-encoding" in headers:
        raise ProtocolError(411, "send the body with a Content-Length (no Transfer-Encoding)")
    if lengths:
        head.length = _content_length(lengths)
    if head.version >= (1, 1) and not headers.get("host"):
        raise ProtocolError(400, "an HTTP/1.1 request needs a Host header")
    if headers.get("expect") and not head.expects_continue:
        raise ProtocolError(417, "only 'Expect: 100-continue' is understood")
    return head


async def read_head(reader: asyncio.StreamReader, deadline: float) -> Head | None:
    """The next request head; None when the client closed cleanly before
    sending one.  ``reader``'s limit bounds the head's size."""
    try:
        async with asyncio.timeout(deadline):
            raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip(b"\r\n"):
            raise ProtocolError(400, "the connection closed in the middle of a request") from None
        return None
    except asyncio.LimitOverrunError:
        raise ProtocolError(431, "request head too large") from None
    except TimeoutError:
        raise ProtocolError(408, f"request head not received within {deadline:g} s") from None
    return parse_head(raw[:-4])


async def read_body(reader: asyncio.StreamReader, length: int, deadline: float) -> bytes:
    try:
        async with asyncio.timeout(deadline):
            return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ProtocolError(400, "the connection closed in the middle of the body") from None
    except TimeoutError:
        raise ProtocolError(408, f"request body not received within {deadline:g} s") from None


def status_text(status: int) -> str:
    """``200 OK``: the status and its reason phrase."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} "


def status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status_text(status)}\r\n".encode("latin-1")


def encode_response(status: int, headers: list[tuple[str, str]], body: bytes, *,
                    head_only: bool = False, close: bool = False) -> bytes:
    lines = [(name, value) for name, value in headers
             if name.lower() not in ("content-length", "connection")]
    lines.append(("Content-Length", str(len(body))))
    if close:
        lines.append(("Connection", "close"))
    out = status_line(status) + b"".join(
        f"{name}: {value}\r\n".encode("latin-1") for name, value in lines) + b"\r\n"
    return out if head_only else out + body


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
