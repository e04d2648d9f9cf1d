"""The nodes an ``amqp://`` URL names: ``amqp://user:pass@h1:5672,h2:5673/vhost``.

pika's ``URLParameters`` takes one host; a RabbitMQ cluster has several, and
a client whose node dies must connect to another.  The spelling is
libpq's and MongoDB's (and duebox's own ``kafka://a:9092,b:9092``):
comma-separated ``HOST[:PORT]`` entries where the one host goes; the user,
password, vhost and query apply to every node.  :func:`node_urls` splits it
into one ordinary URL per node, which pika then reads as always.  Kept
apart from pika so a URL can be checked without it.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from duebox.errors import ConfigurationError

_FORM = "amqp://USER:PASSWORD@HOST1[:PORT1],HOST2[:PORT2]/VHOST"


def node_urls(url: str) -> list[str]:
    """One URL per node, in the order written; refuses an empty entry, a port
    that is not 1-65535 and a node named twice."""
    split = urlsplit(url)
    userinfo, at, hostlist = split.netloc.rpartition("@")
    if "," not in hostlist:
        return [url]
    urls: list[str] = []
    seen: set[tuple[str, int | None]] = set()
    for n, entry in enumerate(hostlist.split(","), 1):
        if not entry:
            raise ConfigurationError(f"broker_url: node {n} of {hostlist!r} is empty; "
                                     f"write {_FORM}")
        node = urlsplit(f"//{entry}")
        try:
            port = node.port
        except ValueError:
            port = -1
        if not node.hostname or port == -1 or port == 0:
            raise ConfigurationError(f"broker_url: node {n} ({entry!r}) is not HOST or "
                                     f"HOST:PORT with a port from 1 to 65535; write {_FORM}")
        key = (node.hostname, port)
        if key in seen:
            raise ConfigurationError(f"broker_url: the node {entry!r} is named twice")
        seen.add(key)
        urls.append(urlunsplit(split._replace(netloc=f"{userinfo}{at}{entry}")))
    return urls
