"""Failed authentication, throttled per client address and in total.

Each refusal of a wrong operator token or a bad CSRF field takes a token
from two buckets: the client's (``per_client`` a window) and everyone's
(``overall`` a window); a bucket refills evenly over its window.  While
either bucket is empty, every mutating request is answered 429 with a
``Retry-After`` before its body is read or its token compared, so guessing
costs an attacker time, not the dashboard work.  The overall bucket caps
guessing from many addresses; its price is that such an attack also holds
back the operator's actions for a while (pages stay readable).

An IPv6 client is counted by its /64 (one host usually owns a whole /64).
Behind a reverse proxy every client has the proxy's address, so the limits
then apply to everyone together.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("duebox.dashboard")

KEEP_CLIENTS = 4096  # buckets remembered (least recently failed dropped first)


@dataclass
class _Bucket:
    tokens: float
    at: float
    # When this bucket's emptying was last logged: an attacker who keeps
    # trying drips a token back every window/size seconds, and each would
    # empty the bucket again; one line a window says it all.
    warned: float = -math.inf


def client_key(address: str) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class Throttle:
    def __init__(self, clock: Callable[[], float], *, per_client: int = 10,
                 overall: int = 100, window: float = 60.0) -> None:
        self._clock = clock
        self._sizes = (per_client, overall)
        self._window = window
        self._clients: OrderedDict[str, _Bucket] = OrderedDict()
        self._overall = _Bucket(float(overall), clock())
        self._lock = threading.Lock()

    def _refill(self, bucket: _Bucket, size: int, now: float) -> _Bucket:
        elapsed = max(0.0, now - bucket.at)
        bucket.tokens = min(float(size), bucket.tokens + elapsed * size / self._window)
        bucket.at = now
        return bucket

    def _wait(self, bucket: _Bucket, size: int) -> float:
        """Seconds until ``bucket`` holds a whole token again (0: it does)."""
        return max(0.0, (1.0 - bucket.tokens) * self._window / size)

    def retry_after(self, client: str) -> int | None:
        """Whole seconds to wait before ``client`` may try again; None when
        it may try now."""
        now = self._clock()
        per_client, overall = self._sizes
        with self._lock:
            mine = self._clients.get(client_key(client))
            wait = self._wait(self._refill(self._overall, overall, now), overall)
            if mine is not None:
                wait = max(wait, self._wait(self._refill(mine, per_client, now), per_client))
        return math.ceil(wait) if wait > 0 else None

    def failed(self, client: str) -> None:
        """Count one failed authentication from ``client``."""
        now = self._clock()
        key = client_key(client)
        per_client, overall = self._sizes
        with self._lock:
            mine = self._clients.pop(key, None) or _Bucket(float(per_client), now)
            self._clients[key] = self._refill(mine, per_client, now)
            while len(self._clients) > KEEP_CLIENTS:
                self._clients.popitem(last=False)
            self._refill(self._overall, overall, now)
            mine.tokens -= 1
            self._overall.tokens -= 1
            if mine.tokens < 1 and now - mine.warned >= self._window:
                mine.warned = now
                log.warning("dashboard: %s failed to authenticate %d times; its actions are "
                            "refused for a while (429)", key, per_client)
            if self._overall.tokens < 1 and now - self._overall.warned >= self._window:
                self._overall.warned = now
                log.warning("dashboard: %d failed authentications in %g s from all clients; "
                            "every action is refused for a while (429)", overall, self._window)
