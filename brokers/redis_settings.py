"""What a ``redis://`` (or ``rediss://``) URL says, checked (see
:mod:`duebox.brokers.redis`), and the keys of a queue.

Kept apart from the backend so a URL can be checked without a connection.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from duebox.credentials import redacted
from duebox.errors import ConfigurationError

from ._common import flag, number

OWN_PARAMS = ("prefix", "horizon", "group", "claim_idle", "max_delay", "cluster")


@dataclass(frozen=True)
class RedisSettings:
    """What a ``redis://`` URL says.  ``client_url`` is the URL without duebox's
    own parameters, for redis-py, with one host; ``seeds`` are every host the
    URL names (several, comma-separated, only for a cluster)."""

    client_url: str
    prefix: str = "duebox"
    horizon: float = 3600.0
    group: str = "duebox"
    claim_idle: float = 30.0
    cluster: bool = False
    seeds: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_url(cls, url: str) -> RedisSettings:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigurationError(f"broker_url: must start with redis:// "
                                     f"(got {redacted(url)!r})")
        query = parse_qsl(parts.query, keep_blank_values=True)
        own = {k: v for k, v in query if k in OWN_PARAMS}
        seeds = _hosts(parts.netloc.rpartition("@")[2], url)
        cluster = flag(own, "cluster", len(seeds) > 1)
        if len(seeds) > 1 and not cluster:
            raise ConfigurationError("broker_url: several hosts are the seeds of a Redis "
                                     "Cluster: drop cluster=0, or give one host")
        if cluster and parts.path.strip("/") not in ("", "0"):
            raise ConfigurationError(f"broker_url: a Redis Cluster has database 0 only "
                                     f"(got {parts.path!r})")
        if len(seeds) > 1:  # redis-py's URL takes one host; the others go as startup nodes
            user = parts.netloc.rpartition("@")
            parts = parts._replace(netloc=f"{user[0]}{user[1]}{_host_text(*seeds[0])}")
        rest = [(k, v) for k, v in query if k not in OWN_PARAMS]
        unknown = sorted({k for k, _ in rest} - (_cluster_params() if cluster
                                                 else _client_params()))
        if unknown:  # redis-py would fail with a TypeError at the first connection
            raise ConfigurationError(
                f"broker_url: unknown parameter {unknown[0]!r} for redis:// (duebox's own: "
                f"{', '.join(OWN_PARAMS)}; the rest go to redis-py's connection)")
        for name in ("prefix", "group"):
            value = own.get(name, "duebox")
            if not value or any(c in value for c in "{}: \t\n"):
                raise ConfigurationError(
                    f"broker_url: {name} must be a non-empty name without braces, colons "
                    f"or spaces (got {value!r})"
                )
        return cls(
            client_url=urlunsplit(parts._replace(query=urlencode(rest))),
            prefix=own.get("prefix", "duebox"),
            horizon=number(own, "horizon", 3600.0, low=0.0, seconds=True),
            group=own.get("group", "duebox"),
            claim_idle=number(own, "claim_idle", 30.0, low=0.1, seconds=True),
            cluster=cluster,
            seeds=seeds if cluster else (),
        )


def _hosts(netloc: str, url: str) -> tuple[tuple[str, int], ...]:
    """``host[:port]`` (or ``[v6]:port``) each, comma-separated; port 6379 if
    not given."""
    hosts = []
    for part in netloc.split(","):
        try:
            one = urlsplit(f"//{part}")
            port = one.port or 6379
        except ValueError:
            one, port = None, 0
        if one is None or (not one.hostname and len(netloc.split(",")) > 1):
            raise ConfigurationError(f"broker_url: {part!r} is not a host[:port] "
                                     f"(in {redacted(url)!r})")
        hosts.append((one.hostname or "localhost", port))
    return tuple(hosts)


def _host_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@functools.cache
def _client_params() -> frozenset[str]:
    """The URL parameters redis-py's connection pool and connections accept."""
    from redis.asyncio import connection as rc

    names = set(getattr(rc, "URL_QUERY_ARGUMENT_PARSERS", {}))
    for cls in (rc.AbstractConnection, rc.Connection, rc.SSLConnection,
                rc.UnixDomainSocketConnection):
        names |= set(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "kwargs", "args"})


@functools.cache
def _cluster_params() -> frozenset[str]:
    """The URL parameters redis-py's ``RedisCluster`` accepts: its own
    arguments, not every connection's (it passes on a fixed set)."""
    from redis.asyncio import RedisCluster

    names = set(inspect.signature(RedisCluster.__init__).parameters)
    return frozenset(names - {"self", "kwargs", "args", "host", "port", "startup_nodes",
                              "db", "path"})


@dataclass(frozen=True)
class Keys:
    due: str
    msg: str
    ready: str
    held: str
    wake: str

    @classmethod
    def of(cls, prefix: str, queue: str) -> Keys:
        tag = f"{prefix}:{{{queue}}}"
        return cls(f"{tag}:due", f"{tag}:msg", f"{tag}:ready", f"{tag}:held", f"{tag}:wake")
