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

from ._common import number

OWN_PARAMS = ("prefix", "horizon", "group", "claim_idle", "max_delay")


@dataclass(frozen=True)
class RedisSettings:
    """What a ``redis://`` URL says.  ``client_url`` is the URL without duebox's
    own parameters, for redis-py."""

    client_url: str
    prefix: str = "duebox"
    horizon: float = 3600.0
    group: str = "duebox"
    claim_idle: float = 30.0

    @classmethod
    def from_url(cls, url: str) -> RedisSettings:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigurationError(f"broker_url: must start with redis:// "
                                     f"(got {redacted(url)!r})")
        query = parse_qsl(parts.query, keep_blank_values=True)
        own = {k: v for k, v in query if k in OWN_PARAMS}
        rest = [(k, v) for k, v in query if k not in OWN_PARAMS]
        unknown = sorted({k for k, _ in rest} - _client_params())
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
        )


@functools.cache
def _client_params() -> frozenset[str]:
    """The URL parameters redis-py's connection pool and connections accept."""
    from redis.asyncio import connection as rc

    names = set(getattr(rc, "URL_QUERY_ARGUMENT_PARSERS", {}))
    for cls in (rc.AbstractConnection, rc.Connection, rc.SSLConnection,
                rc.UnixDomainSocketConnection):
        names |= set(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "kwargs", "args"})


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
