"""Consumers: the worker loop and the dedupe middleware."""

from .dedupe import DUPLICATE, RedisDedupeStore, SQLDedupeStore, dedupe, outbox_id_of
from .worker import Worker, WorkerStats

__all__ = [
    "DUPLICATE",
    "RedisDedupeStore",
    "SQLDedupeStore",
    "Worker",
    "WorkerStats",
    "dedupe",
    "outbox_id_of",
]
