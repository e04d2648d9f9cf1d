"""Where the real brokers are, and small tools to look at and meddle with them.

Shared by the per-backend tests (``test_redis_broker.py``,
``test_amqp_broker.py``) and the contract suite (``tests/contract/``); the
fixtures built on these live in ``conftest.py``.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import redis

REDIS = os.environ.get("DUEBOX_TEST_REDIS", "redis://127.0.0.1:6379/0")
AMQP = os.environ.get("DUEBOX_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")


def with_params(url: str, **params: object) -> str:
    """``url`` with ``?k=v`` parameters appended (after any it already has)."""
    if not params:
        return url
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


def rabbitmqctl(*args: str, timeout: float = 60) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True,
                   timeout=timeout)


class Keys:
    """A look at one test's Redis keys, with a plain synchronous client."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def url(self, **params: object) -> str:
        """The ``redis://`` broker URL for this prefix."""
        return with_params(REDIS, prefix=self.prefix, **params)

    def k(self, part: str, queue: str = "default") -> str:
        return f"{self.prefix}:{{{queue}}}:{part}"

    def parked(self, queue: str = "default") -> int:
        return int(self.client.zcard(self.k("due", queue)))

    def score(self, job_id: uuid.UUID, queue: str = "default") -> float | None:
        return self.client.zscore(self.k("due", queue), str(job_id))

    def held(self, job_id: uuid.UUID, queue: str = "default") -> str | None:
        value = self.client.hget(self.k("held", queue), str(job_id))
        return None if value is None else value.decode()

    def stream_len(self, queue: str = "default") -> int:
        return int(self.client.xlen(self.k("ready", queue)))

    def pending(self, queue: str = "default") -> int:
        try:
            return int(self.client.xpending(self.k("ready", queue), "duebox")["pending"])
        except redis.ResponseError:  # no group yet
            return 0

    def all(self) -> list[bytes]:
        return list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000))

    def wipe(self) -> int:
        """What FLUSHALL does to this backend: every key under the prefix goes."""
        found = self.all()
        return int(self.client.delete(*found)) if found else 0
