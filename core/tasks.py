"""Registered tasks and the context a handler receives."""

from __future__ import annotations

import inspect
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from .errors import ConfigurationError
from .failures import DEFAULT_CLASSIFIER, Classifier, FailureClass, Verdict
from .secret_keys import DEFAULT_MASK_KEYS, SecretKeys
from .validation import MAX_SPAN, text_problem

Handler = Callable[[Any, "JobContext"], Any]

_NAME_MAX = 200
# Backoff doubles per attempt up to the cap; it stops doubling after this
# many, since 2.0 ** 1024 overflows and max_attempts has no ceiling.
_DOUBLINGS = 64


# Attempts a task gets unless it says otherwise: with the default
# RetryPolicy the last of them comes an hour or two after the first, so a
# downstream down for ten minutes (or an hour) is ridden out, not dead-lettered.
DEFAULT_MAX_ATTEMPTS = 10


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with "equal jitter": the wait after attempt n
    is a random time in ``[c/2, c]`` where ``c = min(cap, base * 2**(n-1))``
    (its computed backoff), never less than ``minimum``.  Half the backoff is
    always waited, so no retry comes back at once; the other half is random,
    so jobs that failed together do not return together.

    The defaults wait 7.5-15 s, then 15-30 s, doubling up to 30-60 minutes
    (docs/failures.md has the curve beside Dramatiq's, Sidekiq's and
    Celery's)."""

    base: float = 15.0
    cap: float = 3600.0
    minimum: float = 0.0

    def __post_init__(self) -> None:
        most = MAX_SPAN.total_seconds()
        for name in ("base", "cap", "minimum"):
            value = getattr(self, name)
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or (isinstance(value, float) and math.isnan(value))
                    or not 0 <= value <= most):
                raise ConfigurationError(f"RetryPolicy.{name}: must be a number of seconds from "
                                         f"0 to {most:.0f} (got {value!r})")

    def backoff(self, attempt: int) -> float:
        """The computed backoff after attempt ``attempt``: ``min(cap, base *
        2**(attempt-1))``, the most a retry waits."""
        return min(self.cap, self.base * 2.0 ** min(max(0, attempt - 1), _DOUBLINGS))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        half = self.backoff(attempt) / 2.0
        r: float = (rng or random).random()
        return max(self.minimum, half + half * r)

    def delay_for(self, attempt: int, verdict: Verdict, rng: random.Random | None = None) -> float:
        """The wait before the next attempt, by failure class.

        Throttled failures wait at least their ``Retry-After`` and otherwise
        twice the normal ceiling (harder backoff), plus up to 10 % jitter so
        jobs throttled together do not return together.
        """
        if verdict.failure_class != FailureClass.THROTTLED:
            return self.delay(attempt, rng)
        ceiling = self.backoff(attempt + 1)
        floor = verdict.retry_after
        if floor is None or not math.isfinite(floor):
            floor = ceiling
        r: float = (rng or random).random()
        # A downstream's Retry-After is someone else's input: however large,
        # the retry's due time must stay a date (duebox.validation.MAX_SPAN).
        return min(max(self.minimum, floor) * (1.0 + 0.1 * r), MAX_SPAN.total_seconds())


@dataclass(frozen=True)
class Task:
    name: str
    fn: Handler
    queue: str
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    lease_seconds: float | None = None
    # Failure classification, extendable per task (see duebox.failures).
    classifier: Classifier = DEFAULT_CLASSIFIER
    # Wall-clock limit on one execution, separate from the lease.
    timeout: float | None = None
    # Raises if a payload no longer fits the handler (checked before DLQ replay).
    validate: Callable[[Any], None] | None = None
    # Seconds after due_at past which a job is EXPIRED by the relay, never run.
    max_lateness: float | None = None
    # Hides secrets from people looking at jobs (the dashboard): returns the
    # payload as it may be shown.  Never used when running the job.
    mask: Callable[[Any], Any] | None = None
    # The task's own secret keys (duebox.secret_keys); None: the app's
    # mask_keys setting.  ``secret_keys`` is what applies, set by the app.
    mask_keys: tuple[str, ...] | None = None
    secret_keys: SecretKeys = field(default_factory=lambda: SecretKeys.of(DEFAULT_MASK_KEYS))
    # May share a transaction with other short jobs of the worker (group
    # commit, consumers/batch.py); False: always a transaction alone.
    group_commit: bool = True
    # Keep what the handler returns (duebox.reads.results), for ``result_ttl``
    # seconds (None: the app's setting).  Such a task runs every job in a
    # transaction of its own (group_commit is False).
    store_result: bool = False
    result_ttl: float | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


def validate_task_options(name: object, queue: object, max_attempts: object) -> None:
    if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
        raise ConfigurationError(f"task name: must be a non-empty string of at most {_NAME_MAX} "
                                 f"characters (got {name!r})")
    if (problem := text_problem(name)) is not None:
        raise ConfigurationError(f"task name: {problem} (got {name!r})")
    if not isinstance(queue, str) or not queue or len(queue) > _NAME_MAX:
        raise ConfigurationError(f"queue: must be a non-empty string of at most {_NAME_MAX} "
                                 f"characters (got {queue!r})")
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise ConfigurationError(f"max_attempts: must be an integer >= 1 (got {max_attempts!r})")


def check_task_seconds(**durations: object) -> None:
    """Durations a task adds to instants (``timeout``, ``max_lateness``,
    ``lease_seconds``): None, or a number of seconds > 0 and at most
    :data:`duebox.validation.MAX_SPAN`, so no due time plus one overflows."""
    most = MAX_SPAN.total_seconds()
    for name, value in durations.items():
        if value is None:
            continue
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or (isinstance(value, float) and math.isnan(value)) or not 0 < value <= most):
            raise ConfigurationError(f"{name}: must be a number of seconds > 0 and at most "
                                     f"{most:.0f} ({MAX_SPAN.days} days) (got {value!r})")


class JobControl(Protocol):
    """The worker's side of a running job (see :class:`JobContext`)."""

    @property
    def cancelled(self) -> bool: ...

    def heartbeat(self) -> bool: ...

    def checkpoint(self, state: Any) -> bool: ...


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
    checkpoint_state: Any = None
    control: JobControl | None = None

    @property
    def idempotency_key(self) -> str:
        """Stable across retries and replays: the business key, else the job id.

        Pass it to payment providers and similar APIs so a retry after a
        crash (charge made, completion not recorded) charges nothing new.
        """
        return self.key if self.key is not None else str(self.job_id)

    @property
    def cancelled(self) -> bool:
        """True once the job was cancelled, timed out or its lease was lost.

        Checked at every heartbeat (automatic, every third of the lease): a
        long handler should look at it at safe points and return early.
        """
        return self.control is not None and self.control.cancelled

    def heartbeat(self) -> bool:
        """Renew the lease now; False (and ``cancelled``) if the job was
        cancelled or another worker took it over."""
        return self.control.heartbeat() if self.control is not None else True

    async def aheartbeat(self) -> bool:
        """:meth:`heartbeat` for ``async def`` handlers."""
        import asyncio

        return await asyncio.to_thread(self.heartbeat)

    def checkpoint(self, state: Any) -> bool:
        """Persist progress (JSON); the next attempt gets it as
        ``ctx.checkpoint_state``.  False if the lease was lost."""
        return self.control.checkpoint(state) if self.control is not None else False

    async def acheckpoint(self, state: Any) -> bool:
        import asyncio

        return await asyncio.to_thread(self.checkpoint, state)
