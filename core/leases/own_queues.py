"""Queues your own consumer reads (``Settings.own_consumer_queues``): the
relay publishes their jobs and marks them ``DELIVERED``, a terminal state,
instead of ``ENQUEUED`` (never republished, never reconciled, no duebox
worker expected).  docs/own-consumers.md has the whole contract.

Everything that treats such a queue differently asks here: the relay's mark
(:func:`mark_state`), the settings check (:func:`parse`, :func:`check`) and
the health report.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, and_, case, func, literal, select, update

from ..clock import as_utc, server_time_after
from ..errors import ConfigurationError
from ..registry import broker_class, check_queue_name
from ..states import STARTABLE_STATES, JobState
from ..tables import job
from .claims import start_checks

if TYPE_CHECKING:
    from ..message import MessageRef
    from ..producer import Steps

FIELD = "own_consumer_queues"


def parse(value: object) -> tuple[str, ...]:
    """The setting as a sorted tuple of queue names: a sequence of names, or
    one string of comma-separated names (``DUEBOX_OWN_CONSUMER_QUEUES``)."""
    if value is None:
        return ()
    if isinstance(value, str):
        items: Iterable[object] = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, Iterable) and not isinstance(value, bytes | dict):
        items = list(value)
    else:
        raise ConfigurationError(
            f"{FIELD}: must be a list of queue names or one comma-separated string "
            f"(got {value!r})")
    names = []
    for item in items:
        if not isinstance(item, str) or not item or item != item.strip() or "," in item:
            raise ConfigurationError(
                f"{FIELD}: each queue name must be a non-empty string without ',' or "
                f"surrounding spaces (got {item!r})")
        names.append(item)
    return tuple(sorted(set(names)))


def check(broker_url: str, queues: Collection[str]) -> None:
    """Each queue is one the broker can name, and the broker is one a
    consumer of your own can read: ``sql://`` and ``memory://`` have no queue
    outside the process."""
    if not queues:
        return
    cls = broker_class(broker_url)
    if cls.capabilities.direct_claim or cls.capabilities.name == "memory":
        raise ConfigurationError(
            f"{FIELD}: {cls.capabilities.name}:// has no broker queue a consumer of your own "
            f"could read ({', '.join(queues)}); use amqp://, sqs://, kafka:// or redis://, "
            "or leave these queues to duebox's worker")
    for q in queues:
        try:
            check_queue_name(broker_url, q)
        except Exception as exc:
            raise ConfigurationError(f"{FIELD}: queue {q!r}: {exc}") from exc


def mark_state(queues: Collection[str]) -> ColumnElement[str] | JobState:
    """The state a confirmed publish leaves a job in: ``DELIVERED`` in
    ``queues``, ``ENQUEUED`` elsewhere (a plain value when ``queues`` is
    empty, so the common mark statement is unchanged)."""
    if not queues:
        return JobState.ENQUEUED
    return case((job.c.queue.in_(sorted(queues)), literal(JobState.DELIVERED.value)),
                else_=literal(JobState.ENQUEUED.value))


def finished_at(queues: Collection[str], now: object) -> ColumnElement[object] | None:
    """``finished_at`` for the mark: the publish's time for a delivered job
    (where it ended, for the dashboard and retention), unchanged elsewhere."""
    if not queues:
        return None
    return case((job.c.queue.in_(sorted(queues)), literal(now, job.c.finished_at.type)),
                else_=job.c.finished_at)


# The states your consumer's completion moves to SUCCEEDED: DELIVERED, and
# those a duebox worker may start a job from (the message can overtake the
# relay's mark, DISPATCHING; or be an earlier publish of a job recovery
# returned to SCHEDULED at the same version).
COMPLETABLE_STATES = frozenset(STARTABLE_STATES | {JobState.DELIVERED})


class Completion(StrEnum):
    """What the dedupe decorator's completion found."""

    DONE = "done"  # SUCCEEDED now, in the handler's transaction
    NOT_A_JOB = "not_a_job"  # no such job here: a message from elsewhere
    # another version, task, or a final state, or past its expiry: a stale or
    # forged copy, or one too late to run
    MOVED_ON = "moved_on"
    NOT_DUE = "not_due"  # the right message, early


@dataclass(frozen=True, slots=True)
class Outcome:
    completion: Completion
    due_at: datetime | None = None
    now: datetime | None = None  # NOT_DUE: the clock's reading the due time was compared with


def complete_steps(ref: MessageRef, dialect: str, now: datetime) -> Steps[Outcome]:
    """The job ``ref`` names → SUCCEEDED, fenced: its version and task (a
    message naming no version or task matches no job), and startable as a
    worker's start is (:func:`duebox.leases.claims.startable`) from one of
    :data:`COMPLETABLE_STATES`: due, not expired.  On the database server's
    clock, read in the statement as the worker and the relay read it
    (core/clock.py): a consumer host whose clock runs fast must not run a
    job early.  ``now``: the time without a server (SQLite).  A miss reads
    the row once to say why: early (``NOT_DUE``), or moved on (another
    version or task, a final state, past its expiry)."""
    if ref.version is None or ref.task is None:
        exists = yield select(job.c.id).where(job.c.id == ref.job_id)
        return Outcome(Completion.MOVED_ON if exists.first() is not None else Completion.NOT_A_JOB)
    server = server_time_after(dialect, timedelta(0))
    clock, params = server if server is not None else (literal(now, job.c.due_at.type), {})
    fence = [job.c.id == ref.job_id, job.c.version == ref.version, job.c.task == ref.task]
    checks = start_checks(clock, states=COMPLETABLE_STATES)
    done = yield update(job).where(*fence, and_(*checks)).values(
        state=JobState.SUCCEEDED, finished_at=clock, lease_owner=None, lease_until=None,
        started_at=func.coalesce(job.c.started_at, clock), updated_at=clock), params
    if done.rowcount == 1:
        return Outcome(Completion.DONE)
    found = yield select(job.c.due_at, clock).where(
        *fence, checks.in_state, checks.unexpired), params
    row: Any = found.first()
    if row is not None:
        due_at, read_at = row
        return Outcome(Completion.NOT_DUE, as_utc(due_at), as_utc(read_at))
    exists = yield select(job.c.id).where(job.c.id == ref.job_id)
    return Outcome(Completion.MOVED_ON if exists.first() is not None else Completion.NOT_A_JOB)


__all__ = ["COMPLETABLE_STATES", "FIELD", "Completion", "Outcome", "check", "complete_steps",
           "finished_at", "mark_state", "parse"]
