"""Job states and the transitions between them.

``SCHEDULED`` (parked or waiting) → ``DISPATCHING`` (claimed by a relay, leased)
→ ``ENQUEUED`` (accepted by the broker) → ``RUNNING`` → ``SUCCEEDED`` |
``SCHEDULED`` again (a retry, later ``due_at``) | ``DEAD``; ``CANCELLED`` and
``EXPIRED`` from any non-final state. With the ``sql://`` backend workers claim
``SCHEDULED`` rows straight into ``RUNNING``.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    SCHEDULED = "SCHEDULED"
    DISPATCHING = "DISPATCHING"
    ENQUEUED = "ENQUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    DEAD = "DEAD"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"


FINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED, JobState.EXPIRED})
ACTIVE_STATES = frozenset(set(JobState) - FINAL_STATES)
# States from which a worker may start a job: the relay's mark may not have
# landed yet when the message arrives (DISPATCHING), and a recovered job may be
# started from a redelivered message before a relay claims it again (SCHEDULED).
STARTABLE_STATES = frozenset({JobState.SCHEDULED, JobState.DISPATCHING, JobState.ENQUEUED})
# States that hold a lease which the recovery scan may expire.
LEASED_STATES = frozenset({JobState.DISPATCHING, JobState.ENQUEUED, JobState.RUNNING})
RESCHEDULABLE_STATES = STARTABLE_STATES
