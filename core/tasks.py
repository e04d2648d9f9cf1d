"""Registered tasks and the context a handler receives."""

from __future__ import annotations

import inspect
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .errors import ConfigurationError

Handler = Callable[[Any, "JobContext"], Any]

_NAME_MAX = 200


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter: attempt n waits a random
    time in ``[0, min(cap, base * 2**(n-1))]``, never less than ``minimum``."""

    base: float = 1.0
    cap: float = 300.0
    minimum: float = 0.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        ceiling: float = min(self.cap, self.base * 2.0 ** max(0, attempt - 1))
        r: float = (rng or random).random()
        return max(self.minimum, ceiling * r)


@dataclass(frozen=True)
class Task:
    name: str
    fn: Handler
    queue: str
    max_attempts: int = 3
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    lease_seconds: float | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


def validate_task_options(name: object, queue: object, max_attempts: object) -> None:
    if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
        raise ConfigurationError(f"task name: must be a non-empty string of at most {_NAME_MAX} "
                                 f"characters (got {name!r})")
    if not isinstance(queue, str) or not queue or len(queue) > _NAME_MAX:
        raise ConfigurationError(f"queue: must be a non-empty string of at most {_NAME_MAX} "
                                 f"characters (got {queue!r})")
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise ConfigurationError(f"max_attempts: must be an integer >= 1 (got {max_attempts!r})")


@dataclass
class JobContext:
    """What a handler knows about the job it runs.

    ``session`` is the handler's own database transaction (a sync ``Session``
    for ``def`` handlers, an ``AsyncSession`` for ``async def`` ones): writes
    made through it commit atomically with the dedupe row and the job's
    completion, so they happen once per job id.
    """

    job_id: uuid.UUID
    task: str
    queue: str
    attempt: int
    version: int
    due_at: datetime
    key: str | None
    tenant: str | None
    session: Any
    worker: str
    lease_generation: int

    @property
    def idempotency_key(self) -> str:
        """Stable across retries and replays: the business key, else the job id."""
        return self.key if self.key is not None else str(self.job_id)
