"""Job ids: UUIDv7 (RFC 9562), time-ordered so the primary-key index grows
at its right edge instead of splitting pages at random."""

from __future__ import annotations

import os
import time
import uuid

_RAND_A = 0xFFF << 62
_RAND_B = (1 << 62) - 1
_VERSION_VARIANT = (0x7 << 76) | (0b10 << 62)


def _from_parts(ms: int, rand: int) -> uuid.UUID:
    value = (ms & ((1 << 48) - 1)) << 80 | _VERSION_VARIANT
    value |= (rand & _RAND_A) << 2  # rand_a, 12 bits, above the variant
    value |= rand & _RAND_B  # rand_b
    return uuid.UUID(int=value)


def uuid7() -> uuid.UUID:
    return _from_parts(time.time_ns() // 1_000_000, int.from_bytes(os.urandom(10), "big"))


def uuid7_many(n: int) -> list[uuid.UUID]:
    """``n`` ids of one millisecond, from one read of the random source
    instead of a syscall per id."""
    ms = time.time_ns() // 1_000_000
    pool = os.urandom(10 * n)
    return [_from_parts(ms, int.from_bytes(pool[i:i + 10], "big")) for i in range(0, 10 * n, 10)]


def parse_job_id(value: object, field: str = "job_id") -> uuid.UUID:
    from .errors import ValidationError

    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ValidationError(field, "must be a UUID", value) from None


def process_token(role: str) -> str:
    """A name for this process that is unique across restarts and hosts."""
    host = os.uname().nodename[:40]
    return f"{role}:{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
