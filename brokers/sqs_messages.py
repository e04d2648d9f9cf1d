"""What a duebox message becomes in an ``sqs://`` ``SendMessageBatch``.

Each message is an entry with its attributes (the envelope's header fields)
and the moment to send it, so that whole-second ``DelaySeconds`` ends just
after its due time; entries are grouped into calls of at most 10 entries and
``max_message_size`` bytes that go out at the same moment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from duebox.errors import ValidationError
from duebox.message import JobMessage

from ._common import safe_token
from .base import Outgoing
from .sqs_settings import MAX_DELAY_SECONDS, SQSSettings

BATCH = 10  # entries per call, SQS's limit


@dataclass
class Entry:
    """One message on its way into a ``SendMessageBatch`` call."""

    index: int
    request: dict[str, Any]
    size: int
    visible_at: float | None  # epoch seconds; None: at once
    send_at: float  # epoch seconds


def attributes(msg: JobMessage) -> dict[str, dict[str, str]]:
    """The envelope's header fields as SQS message attributes."""
    return {name: {"DataType": "String", "StringValue": value}
            for name, value in msg.header_map().items()}


def message_size(body: str, attrs: dict[str, dict[str, str]]) -> int:
    """What SQS counts against its size limit: the body plus every
    attribute's name, type and value, in UTF-8 bytes."""
    size = len(body.encode())
    for name, attr in attrs.items():
        size += len(name.encode()) + len(attr["DataType"].encode())
        size += len(attr["StringValue"].encode())
    return size


def make_entry(settings: SQSSettings, i: int, out: Outgoing, now: float) -> Entry | str:
    """The request for one message, or the reason it cannot be sent
    (:class:`ValidationError`: one SQS refuses every time)."""
    msg = out.message
    if settings.fifo and out.delay > 0:
        return ("sqs:// FIFO queues cannot delay a message (max_delay is 0): the relay "
                "publishes FIFO jobs at their due time")
    settings.queue_name(msg.queue)
    body = msg.encode().decode()
    attrs = attributes(msg)
    size = message_size(body, attrs)
    if size > settings.max_message_size:
        raise ValidationError(
            "payload", f"the message is {size} bytes with its attributes; SQS takes at "
            f"most {settings.max_message_size} (max_message_size); keep large "
            f"data elsewhere and pass a reference")
    request: dict[str, Any] = {"Id": str(i), "MessageBody": body,
                               "MessageAttributes": attrs}
    if settings.fifo:
        request["MessageGroupId"] = safe_token(msg.ordering_key())
        request["MessageDeduplicationId"] = f"{msg.job_id}.{msg.version}"
    visible_at = None
    if out.delay > 0:
        # Never before the due time, nor before the delay the relay gave.
        visible_at = min(msg.due_at.timestamp(), now + min(out.delay, MAX_DELAY_SECONDS))
    return Entry(i, request, size, visible_at, send_at(settings, visible_at, now))


def send_at(settings: SQSSettings, visible_at: float | None, now: float) -> float:
    """When to send so that whole-second ``DelaySeconds`` ends just after
    ``visible_at``: at ``visible_at - floor(visible_at - now)``, rounded up
    to the next ``align`` step (a batch goes out per step)."""
    step = settings.align
    if visible_at is None or step <= 0:
        return now
    wait = (visible_at - now) % 1.0
    if wait <= 0:
        return now
    return now + min(1.0, math.ceil(wait / step) * step)


def chunks(settings: SQSSettings, entries: list[Entry]) -> list[list[Entry]]:
    """At most 10 entries and ``max_message_size`` bytes per call, of
    entries that go out at the same moment."""
    out: list[list[Entry]] = []
    size = 0
    for e in sorted(entries, key=lambda e: e.send_at):
        if not out or len(out[-1]) >= BATCH or e.send_at != out[-1][0].send_at \
                or size + e.size > settings.max_message_size:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e.size
    return out
