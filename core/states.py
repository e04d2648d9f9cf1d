"""Job states and the transitions between them.

``SCHEDULED`` (parked or waiting) → ``DISPATCHING`` (claimed by a relay, leased)
→ ``ENQUEUED`` (accepted by the broker) → ``RUNNING`` → ``SUCCEEDED`` |
``SCHEDULED`` again (a retry, later ``due_at``) | ``DEAD``; ``CANCELLED`` and
``EXPIRED`` from any non-final state. With the ``sql://`` backend workers claim
``SCHEDULED`` rows straight into ``RUNNING``.

A queue consumed by your own loop (``Settings.own_consumer_queues``, see
docs/own-consumers.md) ends ``DISPATCHING`` → ``DELIVERED`` instead of
``ENQUEUED``: the broker confirmed the message and duebox's part is done.  The
dedupe decorator may still complete such a job, ``DELIVERED`` → ``SUCCEEDED``,
and until it did a cancel or reschedule may still move it on (a new version
the message it was given does not match).
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    SCHEDULED = "SCHEDULED"
    DISPATCHING = "DISPATCHING"
    ENQUEUED = "ENQUEUED"
    # Handed to a queue your own consumer reads: terminal for duebox (never
    # republished, never reconciled), though not necessarily handled yet.
    DELIVERED = "DELIVERED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    DEAD = "DEAD"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"


FINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED, JobState.EXPIRED,
                          JobState.DELIVERED})
ACTIVE_STATES = frozenset(set(JobState) - FINAL_STATES)
# States from which a worker may start a job: the relay's mark may not have
# landed yet when the message arrives (DISPATCHING), and a recovered job may be
# started from a redelivered message before a relay claims it again (SCHEDULED).
STARTABLE_STATES = frozenset({JobState.SCHEDULED, JobState.DISPATCHING, JobState.ENQUEUED})
# States that hold a lease which the recovery scan may expire.
LEASED_STATES = frozenset({JobState.DISPATCHING, JobState.ENQUEUED, JobState.RUNNING})
# A job handed to a queue your own consumer reads (DELIVERED) has not run as
# far as duebox knows: the dedupe decorator's completion takes it to
# SUCCEEDED in the handler's transaction, fenced on its version, so a cancel
# or reschedule that bumps the version keeps the message it was given from
# running (docs/own-consumers.md).
RESCHEDULABLE_STATES = STARTABLE_STATES | {JobState.DELIVERED}
CANCELLABLE_STATES = ACTIVE_STATES | {JobState.DELIVERED}


class LeaseVerdict(StrEnum):
    """Whether a worker's lease on a job still holds, read under the lock
    or just before a job held ahead of its due time runs."""

    HELD = "held"
    CANCELLED = "cancelled"  # the job was cancelled meanwhile
    LOST = "lost"  # taken over, finished or rescheduled


class Discard(StrEnum):
    """Why a delivered message does not start its job (the worker drops
    it, or looks again later); also the ``reason`` label of the discard
    metric and of a backend's ``reject``."""

    UNKNOWN_JOB = "unknown_job"
    STALE_VERSION = "stale_version"  # the job moved on (retried, rescheduled)
    CANCELLED = "cancelled"
    FORGED = "forged"  # the right id naming another task or queue
    EXPIRED = "expired"  # past expires_at
    NOT_DUE = "not_due"  # early: looked at again when due
    LOCKED = "locked"  # the row was busy, not gone: looked at again shortly
    DEFER_REFUSED = "defer_refused"  # the broker would not take an early message back
    UNDECODABLE = "undecodable"
    TOO_LARGE = "too_large"
    TOO_DEEP = "too_deep"
    ALREADY_RUNNING = "already_running"
    ALREADY_SUCCEEDED = "already_succeeded"
    ALREADY_DEAD = "already_dead"
    ALREADY_EXPIRED = "already_expired"
    ALREADY_DELIVERED = "already_delivered"  # handed to your own consumer's queue
    ALREADY_CANCELLED = "already_cancelled"

    @classmethod
    def already(cls, state: str) -> Discard:
        """The job is past the states a message can start it from."""
        return cls("already_" + str(state).lower())
