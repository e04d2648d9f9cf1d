"""Job ids: UUIDv7 (RFC 9562), time-ordered so the primary-key index grows
at its right edge instead of splitting pages at random."""

from __future__ import annotations

import os
import time
import uuid


def uuid7() -> uuid.UUID:
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= ((rand >> 62) & 0xFFF) << 64  # rand_a, 12 bits
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # rand_b
    return uuid.UUID(int=value)


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
