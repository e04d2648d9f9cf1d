"""The types of the broker seam that core and the backends share: what a
backend can do (:class:`Capabilities`), what it may use of the application
(:class:`BrokerContext`), what the relay hands it (:class:`Outgoing`) and
what it answers (:class:`PublishResult`).

They live in core so that core (``Duebox.broker``) builds a backend's context
without importing a backend; the backends' interface itself,
``duebox.brokers.base.Broker``, re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from .clock import Clock
from .errors import ValidationError
from .message import JobMessage

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from .config import Settings


class Ordering(StrEnum):
    """In which order a backend delivers due messages."""

    NONE = "none"  # no order promised (SQS standard queues)
    DUE = "due"  # by due time within a queue (or a claim); concurrent consumers interleave
    PER_PARTITION = "per partition"  # Kafka: per partition, by ordering key
    PER_GROUP = "per group"  # SQS FIFO: per message group


class Durability(StrEnum):
    """What keeps a published message through a crash."""

    NONE = "none"  # process memory only
    BROKER = "broker"  # the broker's own persistence
    DATABASE = "database"  # the job table itself (sql://)


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees, stated as data.

    ``max_delay``: longest native delay in seconds (``None``: unbounded, 0:
    none — the relay holds near-due jobs and publishes each at its due time).
    ``delay_precision``: the granularity of that delay; the relay rounds up to
    it so nothing becomes visible early.  ``direct_claim``: workers claim due
    rows from the job table themselves and the relay publishes nothing.
    ``publish_lead``: set where the broker's own delay is too coarse (or
    absent) for a precise hand-over: the relay holds near-due jobs in memory
    (still leased) and publishes each this many seconds before its due time,
    with no delay; the worker waits out the rest.  ``None``: near-due jobs go
    through the broker's delay like any other.  ``ordering`` and
    ``durability`` are the kinds the contract suite checks;
    ``ordering_note`` and ``durability_note`` say the backend's particulars.
    ``prompt_redelivery``: what a dead consumer held comes back within
    seconds of its death (the connection closing, or the owner known dead),
    not after a visibility timeout or a group's session timeout; the
    worker's batch lane, which leaves a message's job unstarted until its
    batch commits, runs only there (consumers/runner.py).
    """

    name: str
    max_delay: float | None
    delay_precision: float
    cancel: bool
    ordering: Ordering
    durability: Durability
    payload_limit: int | None
    redelivers_unacked: bool
    in_flight_after_cancel: str
    direct_claim: bool = False
    publish_lead: float | None = None
    ordering_note: str = ""
    durability_note: str = ""
    prompt_redelivery: bool = False


@dataclass(frozen=True)
class BrokerContext:
    """What a backend may use from the application around it."""

    engine: Engine
    clock: Clock
    settings: Settings
    worker_name: str = "worker"


@dataclass(frozen=True)
class PublishResult:
    """``error``: the broker's reason when not ``ok``.  ``permanent``: the
    broker will refuse this message every time (a queue name it cannot use,
    a message over its size limit): the relay counts it as a failed attempt
    of the job, which ends DEAD with the reason, instead of publishing it
    again forever."""

    job_id: Any
    ok: bool
    broker_message_id: str | None = None
    error: str | None = None
    permanent: bool = False


def refused(job_id: Any, exc: ValidationError) -> PublishResult:
    """The result of a message a backend refuses for good."""
    return PublishResult(job_id, False, error=str(exc), permanent=True)


@dataclass(frozen=True)
class Outgoing:
    """A message and the delay (seconds, already clipped and rounded) to give it."""

    message: JobMessage
    delay: float


__all__ = ["BrokerContext", "Capabilities", "Durability", "Ordering", "Outgoing",
           "PublishResult", "refused"]
