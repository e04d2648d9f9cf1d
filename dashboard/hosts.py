"""Where the dashboard listens, and which ``Host`` headers it answers.

DNS rebinding: a page on a foreign site points its own name at the address
the dashboard listens on, and the victim's browser then reads the dashboard
as that site.  Such a request carries the foreign *name* in its Host header,
so the rule is about names: an IP literal cannot be rebound, a name can.

* ``localhost`` and loopback IP literals (``127.0.0.0/8``, ``[::1]``) are
  always answered;
* the bound address itself, written as an IP literal; when bound to every
  address (``0.0.0.0`` / ``::``), any IP literal;
* any other name only if it was allowed explicitly (``--allow-host``): the
  name people type, or the one the reverse proxy in front forwards.

The port in the header is not compared: a proxy may forward another.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

_PORT = re.compile(r"[0-9]{1,5}")
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (a name, an IPv4 or an IPv6
    address, without brackets) and ``port``; OSError if it cannot bind."""
    family, _, _, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address[:2], family=family, backlog=128)


def host_name(header: str) -> str | None:
    """The name or address in a Host header, lower case, without port or
    brackets; None when the header is malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        name, bracket, port = header[1:].partition("]")
        if not bracket or not isinstance(_address(name), ipaddress.IPv6Address):
            return None
        if port and not port.startswith(":"):
            return None
        port = port[1:]
    elif header.count(":") > 1:
        return None  # an IPv6 literal without brackets
    else:
        name, _, port = header.partition(":")
    if port and not _PORT.fullmatch(port):
        return None
    return name.rstrip(".") or None


def _address(name: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class HostAllowList:
    def __init__(self, bound: str, names: Iterable[str] = ()) -> None:
        self.bound = ipaddress.ip_address(bound)
        self.names = frozenset(checked_name(n) for n in names) | {"localhost"}

    def allows(self, header: str) -> bool:
        name = host_name(header)
        if name is None:
            return False
        if name in self.names:
            return True
        ip = _address(name)
        if ip is None:
            return False  # a DNS name nobody allowed
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        return ip.is_loopback or ip == self.bound or self.bound.is_unspecified


def checked_name(name: str) -> str:
    """An ``--allow-host`` value: a DNS name or an IP address."""
    from duebox.errors import ValidationError

    clean = name.strip().lower().rstrip(".")
    if _address(clean.strip("[]")) is not None:
        return clean.strip("[]")
    if not _NAME.fullmatch(clean) or len(clean) > 253:
        raise ValidationError("allow_host", "must be a DNS name (e.g. dashboard.example.com) "
                                            "or an IP address, without a port", name)
    return clean
