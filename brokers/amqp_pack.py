"""Packs: jobs due now, of one queue, in one RabbitMQ message.

A persistent, confirmed RabbitMQ message costs the broker about 0.2 ms of
CPU from publish to ack, and pika about as much again on the two sides:
more than everything else a no-op job costs.  Jobs the relay hands over
already due (a backlog, a burst) need no delay of their own, so the
backend publishes those of one queue together — up to ``?pack=`` of them
(default 32; ``pack=1`` turns it off) and :data:`PACK_BYTES` — as one
message, and the consumer unpacks it into one delivery per job.  Nothing
else changes: each job is still started version-checked and run once, and
each envelope inside is the one a single message carries.

The pack's message is acknowledged when every one of its jobs is settled
(run, discarded, or deferred as a message of its own): a worker that dies
first leaves it unacknowledged and RabbitMQ delivers the whole pack again,
whose settled jobs the version check then discards.  Jobs with a delay,
and every job of a queue your own consumer reads (docs/own-consumers.md),
go one per message as before.

A pack is recognised by its ``duebox-pack`` header; its body is
``{"format": "duebox-pack/1", "jobs": [envelope, ...]}``.  Decoding bounds
it like a single message (size, depth) and the number of jobs
(:data:`MAX_PACK_JOBS`); an envelope inside that does not decode is a
delivery of its own that the worker discards with the reason.

Rolling upgrades: a worker older than packs rejects a pack as undecodable
(into the dead-letter queue) and its jobs are published again after
``redeliver_after``: upgrade workers before relays, or publish with
``?pack=1`` until every worker is upgraded.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from duebox.errors import MessageDecodeError
from duebox.message import MAX_BODY_BYTES, MAX_JSON_DEPTH, JobMessage, too_deep
from duebox.seam import Outgoing
from duebox.states import Discard

PACK_FORMAT = "duebox-pack/1"
HEADER_PACK = "duebox-pack"  # how many jobs the message carries
DEFAULT_PACK = 32
# The most jobs a consumer takes from one message: a pack is a duebox
# relay's, which never makes one larger than ``?pack=`` (at most this).
MAX_PACK_JOBS = 1000
# A pack's body at most; a job whose envelope alone is larger goes alone.
PACK_BYTES = 1 << 20
# The pack object and its list wrap each envelope in two more levels.
_PACK_DEPTH = MAX_JSON_DEPTH + 2


def units(batch: Sequence[Outgoing], bodies: Sequence[bytes | None], most: int,
          own: Collection[str]) -> list[list[int]]:
    """The messages to publish for ``batch``: lists of indexes into it, in
    order.  Due jobs (no delay) of a queue not in ``own`` share messages,
    queue by queue, up to ``most`` jobs and :data:`PACK_BYTES` each
    (``bodies``: their envelopes, encoded; None for the rest); every other
    job is a message of its own."""
    out: list[list[int]] = []
    open_by_queue: dict[str, tuple[list[int], int]] = {}
    for i, out_msg in enumerate(batch):
        body = bodies[i]
        queue = out_msg.message.queue
        if most <= 1 or body is None or out_msg.delay > 0 or queue in own:
            out.append([i])
            continue
        unit, size = open_by_queue.get(queue, ([], 0))
        if unit and (len(unit) >= most or size + len(body) > PACK_BYTES):
            unit, size = [], 0
        if not unit:
            out.append(unit)
        unit.append(i)
        open_by_queue[queue] = (unit, size + len(body) + 1)
    return out


def encode(bodies: Sequence[bytes]) -> bytes:
    """The pack's body, from its jobs' encoded envelopes (not encoded again)."""
    return b'{"format":"' + PACK_FORMAT.encode() + b'","jobs":[' + b",".join(bodies) + b"]}"


def decode(body: bytes, max_bytes: int | None = None) -> list[JobMessage | MessageDecodeError]:
    """The jobs of a pack, each a message or the reason its envelope does
    not decode; :class:`MessageDecodeError` when the pack itself does not."""
    limit = MAX_BODY_BYTES if max_bytes is None else max_bytes
    if len(body) > limit:
        raise MessageDecodeError("body", f"must be at most {limit} bytes (the broker's "
                                 "message limit)", f"{len(body)} bytes",
                                 reason=Discard.TOO_LARGE)
    if too_deep(body, _PACK_DEPTH):
        raise MessageDecodeError("body", f"must nest at most {_PACK_DEPTH} levels deep (a "
                                 "pack)", body[:40], reason=Discard.TOO_DEEP)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise MessageDecodeError("body", "must be a JSON duebox pack", body[:100]) from exc
    if not isinstance(data, dict) or data.get("format") != PACK_FORMAT:
        raise MessageDecodeError("format", f"must be {PACK_FORMAT!r} (a pack)",
                                 data.get("format") if isinstance(data, dict) else data)
    jobs = data.get("jobs")
    if not isinstance(jobs, list) or not jobs:
        raise MessageDecodeError("jobs", "must be a non-empty list of envelopes", jobs)
    if len(jobs) > MAX_PACK_JOBS:
        raise MessageDecodeError("jobs", f"must hold at most {MAX_PACK_JOBS} envelopes",
                                 len(jobs))
    out: list[JobMessage | MessageDecodeError] = []
    for envelope in jobs:
        try:
            if not isinstance(envelope, dict):
                raise MessageDecodeError("jobs", "must hold JSON objects", envelope)
            out.append(JobMessage.from_data(envelope))
        except MessageDecodeError as exc:
            out.append(exc)
    return out


@dataclass(eq=False)
class Pack:
    """One pack delivered to this consumer, settled once each of its jobs
    (``0 .. size - 1``) is.  Jobs given back unhandled (the consumer
    stopped before it handed them out) are kept in :attr:`given_back`:
    when some jobs of the pack were handled, the consumer publishes those
    again and acks the pack (its finished jobs must not come back); when
    none were, the pack is simply requeued."""

    size: int
    given_back: list[JobMessage] = field(default_factory=list)
    _out: set[int] = field(default_factory=set)
    _handled: int = 0

    def __post_init__(self) -> None:
        self._out = set(range(self.size))

    def settle(self, job: int, given_back: JobMessage | None = None,
               handled: bool = True) -> str | None:
        """Job ``job`` of the pack settled — ``handled`` (run, discarded or
        deferred), or given back unhandled (``handled=False``, its message
        ``given_back``, None for an envelope that did not decode).  Settling
        one twice changes nothing.  Returns what to do with the message now:
        ``"ack"``, ``"requeue"`` (nothing of it was handled), ``"republish"``
        (publish :attr:`given_back`, then ack), or None while jobs of it are
        still out."""
        if job not in self._out:
            return None
        self._out.discard(job)
        if handled:
            self._handled += 1
        elif given_back is not None:
            self.given_back.append(given_back)
        if self._out:
            return None
        if not self.given_back:
            return "ack"
        return "republish" if self._handled else "requeue"


__all__ = ["DEFAULT_PACK", "HEADER_PACK", "MAX_PACK_JOBS", "PACK_BYTES", "PACK_FORMAT", "Pack",
           "decode", "encode", "units"]
