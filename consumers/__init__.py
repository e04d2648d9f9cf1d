"""Consumers: the worker loop and the dedupe middleware."""

from .dedupe import SQLDedupeStore
from .worker import Worker, WorkerStats

__all__ = ["SQLDedupeStore", "Worker", "WorkerStats"]
