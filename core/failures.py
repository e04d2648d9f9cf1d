"""Why a job failed, and what that means for its next attempt.

Four classes, as the deep dive lays them out:

- ``transient`` — a timeout, a reset connection: retry with the task's backoff;
- ``throttled`` — the downstream said "slow down" (HTTP 429, a rate-limit
  error): retry no sooner than its ``Retry-After`` and back off harder;
- ``permanent`` — the request itself is wrong (HTTP 4xx, a validation or
  business-rule rejection): no retry, straight to the dead-letter queue;
- ``unknown`` — anything else: retry, relying on idempotency
  (``ctx.idempotency_key``), because the side effect may or may not have
  happened.

Handlers signal a class by raising :class:`Permanent`, :class:`Transient` or
:class:`Throttled`, or let the :class:`Classifier` map their own exception
types (per task, extensible).
"""

from __future__ import annotations

import email.utils
import math
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from .errors import DueboxError


class FailureClass(StrEnum):
    TRANSIENT = "transient"
    THROTTLED = "throttled"
    PERMANENT = "permanent"
    UNKNOWN = "unknown"


class SystemFailure(StrEnum):
    """Error classes duebox writes when an attempt ends for a reason outside
    the handler (``FailureClass`` is the handler's): together they are every
    value of the ``error_class`` column."""

    LOST = "lost"  # the worker vanished (lease expired, process died)
    EXPIRED = "expired"  # too late to run: past expires_at or max_lateness
    REFUSED = "refused"  # the broker refuses its message for good


class JobFailure(DueboxError):
    """Base of the exceptions a handler raises to say how it failed."""

    failure_class = FailureClass.UNKNOWN


class Transient(JobFailure):
    """Retry with the task's backoff (a timeout, a dropped connection)."""

    failure_class = FailureClass.TRANSIENT


class Permanent(JobFailure):
    """Never retry: the job goes to the dead-letter queue at once."""

    failure_class = FailureClass.PERMANENT


class HandlerSessionError(Permanent):
    """A handler ended the transaction duebox runs it in (``ctx.session``
    ``commit()``, ``rollback()``, ``close()``, a second ``begin()``, an
    invalidated connection).  Its writes, the dedupe row and the job's
    completion must commit together, so duebox ends that transaction: the
    attempt fails with this, its writes rolled back, and — a bug a retry
    would repeat — the job goes to the dead-letter queue."""


class HandlerAbortError(JobFailure):
    """A handler raised a ``BaseException`` that is not an ``Exception``
    (``SystemExit``, ``KeyboardInterrupt`` raised by its own code): in a
    worker's thread that stops nothing but the handler, so it fails the
    attempt like any error instead of ending the worker."""


class Throttled(JobFailure):
    """The downstream asked to slow down; retry after ``retry_after`` seconds."""

    failure_class = FailureClass.THROTTLED

    def __init__(self, message: str = "throttled", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Verdict:
    failure_class: FailureClass
    retry_after: float | None = None


ClassRule = FailureClass | str | Callable[[BaseException], "Verdict | FailureClass | str | None"]


class Classifier:
    """Maps exceptions to failure classes.

    Rules are looked up along the exception's MRO, so ``{OSError: "transient"}``
    covers ``ConnectionResetError``.  A rule may be a class name or a callable
    returning a :class:`Verdict`, a class, or ``None`` to fall through.
    ``extend`` returns a new classifier; tasks take one with ``classify=``.
    """

    def __init__(self, rules: Mapping[type[BaseException], ClassRule] | None = None) -> None:
        self.rules: dict[type[BaseException], ClassRule] = dict(rules or {})

    def extend(self, rules: Mapping[type[BaseException], ClassRule]) -> Classifier:
        merged = dict(self.rules)
        merged.update(rules)
        return Classifier(merged)

    def classify(self, exc: BaseException) -> Verdict:
        if isinstance(exc, Throttled):
            return Verdict(FailureClass.THROTTLED, exc.retry_after)
        if isinstance(exc, JobFailure):
            return Verdict(exc.failure_class)
        for cls in type(exc).__mro__:
            rule = self.rules.get(cls)
            if rule is None:
                continue
            verdict = _apply(rule, exc)
            if verdict is not None:
                return verdict
        http = _http_verdict(exc)
        return http or Verdict(FailureClass.UNKNOWN)


def _apply(rule: ClassRule, exc: BaseException) -> Verdict | None:
    if isinstance(rule, FailureClass | str):
        return Verdict(FailureClass(rule))
    out = rule(exc)
    if out is None or isinstance(out, Verdict):
        return out
    return Verdict(FailureClass(out))


def _http_verdict(exc: BaseException) -> Verdict | None:
    """Exceptions carrying an HTTP status (``requests``, ``httpx``, ``urllib``)."""
    response = getattr(exc, "response", None)
    status = getattr(exc, "status_code", None) or getattr(exc, "code", None) or getattr(
        response, "status_code", None
    )
    if not isinstance(status, int) or not 400 <= status <= 599:
        return None
    headers = getattr(response, "headers", None) or getattr(exc, "headers", None) or {}
    if status == 429 or (status == 503 and _header(headers, "Retry-After")):
        return Verdict(FailureClass.THROTTLED, parse_retry_after(_header(headers, "Retry-After")))
    if status in (408, 425) or status >= 500:
        return Verdict(FailureClass.TRANSIENT)
    return Verdict(FailureClass.PERMANENT)


def _header(headers: Any, name: str) -> str | None:
    try:
        value = headers.get(name)
    except AttributeError:
        return None
    return value if isinstance(value, str) else None


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date (RFC 9110)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


DEFAULT_CLASSIFIER = Classifier({
    TimeoutError: FailureClass.TRANSIENT,
    ConnectionError: FailureClass.TRANSIENT,
})


# A failed attempt's traceback is kept whole up to this many characters; a
# longer one (deep recursion, a huge message) keeps its start, where the
# handler was entered, and its end, where it raised.
TRACEBACK_MAX = 16_000
_TRACEBACK_HEAD = 2_000


def error_line(exc: BaseException) -> str:
    """``module.Class: message``, what an attempt records as its error."""
    return "".join(traceback.format_exception_only(exc)).strip()


def bounded_traceback(exc: BaseException, limit: int = TRACEBACK_MAX) -> str:
    """The formatted traceback of ``exc`` (with its causes), at most about
    ``limit`` characters."""
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    if len(text) <= limit:
        return text
    head, tail = text[:_TRACEBACK_HEAD], text[len(text) - (limit - _TRACEBACK_HEAD):]
    return f"{head}\n... ({len(text) - limit} characters cut) ...\n{tail}"
