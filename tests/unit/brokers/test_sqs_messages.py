"""duebox.brokers.sqs_messages: a message's way into ``SendMessageBatch``.

The timing arithmetic: SQS delays in whole seconds, so a message is sent a
fraction of a second late (rounded up to the ``align`` step) and its
``DelaySeconds`` ends at or after its due time, never before it and never
a step or more after it.  And the entries: attributes, size as SQS counts
it, FIFO fields, calls of at most 10 entries and ``max_message_size``."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox import ValidationError
from duebox.brokers.base import Outgoing
from duebox.brokers.sqs_messages import BATCH, Entry, chunks, make_entry, message_size, send_at
from duebox.brokers.sqs_settings import MAX_DELAY_SECONDS, SQSSettings
from duebox.message import JobMessage

NOW = datetime(2030, 1, 1, tzinfo=UTC).timestamp()


def message(due_in: float = 0.0, queue: str = "mail", **headers: object) -> JobMessage:
    return JobMessage(job_id=uuid.UUID(int=5), task="t", queue=queue, version=2, attempt=0,
                      due_at=datetime.fromtimestamp(NOW + due_in, UTC), payload={"x": 1},
                      headers=dict(headers))


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, max_value=2000.0), st.floats(min_value=0.001, max_value=2000.0),
       st.sampled_from([0.02, 0.001, 0.3, 0.5, 1.0]))
def test_a_delayed_message_becomes_visible_at_its_due_time_never_before(
        due_in: float, delay: float, align: float) -> None:
    s = SQSSettings(align=align)
    msg = message(due_in)
    entry = make_entry(s, 0, Outgoing(msg, delay), NOW)
    assert isinstance(entry, Entry)
    assert entry.visible_at is not None
    target = min(msg.due_at.timestamp(), NOW + min(delay, MAX_DELAY_SECONDS))
    assert entry.visible_at == target
    assert NOW <= entry.send_at <= NOW + 1.0
    # What the backend asks of SQS when it sends at send_at (brokers/sqs.py).
    delay_seconds = min(MAX_DELAY_SECONDS, math.ceil(entry.visible_at - entry.send_at))
    visible = entry.send_at + max(0, delay_seconds)
    assert target - 1e-6 <= visible < target + align + 1e-6


def test_an_immediate_message_goes_at_once() -> None:
    entry = make_entry(SQSSettings(), 3, Outgoing(message(), 0.0), NOW)
    assert isinstance(entry, Entry)
    assert (entry.visible_at, entry.send_at, entry.index) == (None, NOW, 3)
    assert send_at(SQSSettings(align=0), NOW + 5.5, NOW) == NOW  # no alignment asked


def test_the_entry_carries_the_envelope_as_attributes_and_counts_them() -> None:
    msg = message()
    entry = make_entry(SQSSettings(), 0, Outgoing(msg, 0.0), NOW)
    assert isinstance(entry, Entry)
    attrs = entry.request["MessageAttributes"]
    assert {k: v["StringValue"] for k, v in attrs.items()} == msg.header_map()
    assert all(v["DataType"] == "String" for v in attrs.values())
    assert entry.request["MessageBody"] == msg.encode().decode()
    assert entry.size == message_size(entry.request["MessageBody"], attrs)
    assert message_size("é", {"k": {"DataType": "String", "StringValue": "ü"}}) == 2 + 1 + 6 + 2
    assert "MessageGroupId" not in entry.request


def test_fifo_groups_by_ordering_key_and_dedupes_by_id_and_version() -> None:
    fifo = SQSSettings(fifo=True)
    keyed = make_entry(fifo, 0, Outgoing(message(ordering_key="acct 7/ü"), 0.0), NOW)
    plain = make_entry(fifo, 0, Outgoing(message(), 0.0), NOW)
    assert isinstance(keyed, Entry)
    assert isinstance(plain, Entry)
    assert len(keyed.request["MessageGroupId"]) == 64  # the key's digest: SQS's characters
    assert plain.request["MessageGroupId"] == str(uuid.UUID(int=5))
    assert plain.request["MessageDeduplicationId"] == f"{uuid.UUID(int=5)}.2"
    refused = make_entry(fifo, 0, Outgoing(message(60), 60.0), NOW)
    assert isinstance(refused, str)
    assert "FIFO queues cannot delay" in refused


def test_a_message_sqs_would_refuse_every_time_is_refused_by_field() -> None:
    small = SQSSettings(max_message_size=1024)
    big = JobMessage(job_id=uuid.UUID(int=5), task="t", queue="mail", version=1, attempt=0,
                     due_at=datetime.fromtimestamp(NOW, UTC), payload="x" * 2000)
    with pytest.raises(ValidationError) as too_big:
        make_entry(small, 0, Outgoing(big, 0.0), NOW)
    assert too_big.value.field == "payload"
    assert "max_message_size" in str(too_big.value)
    with pytest.raises(ValidationError) as bad_queue:
        make_entry(SQSSettings(), 0, Outgoing(message(queue="a.b"), 0.0), NOW)
    assert bad_queue.value.field == "queue"


def entry(i: int, size: int, send: float) -> Entry:
    return Entry(i, {}, size, None, send)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=1, max_value=400),
                          st.sampled_from([0.0, 0.02, 0.04])), max_size=40))
def test_calls_hold_at_most_ten_entries_and_the_size_limit_of_one_moment(
        specs: list[tuple[int, float]]) -> None:
    s = SQSSettings(max_message_size=1024)
    entries = [entry(i, size, NOW + send) for i, (size, send) in enumerate(specs)]
    calls = chunks(s, entries)
    assert sorted(e.index for call in calls for e in call) == list(range(len(specs)))
    for call in calls:
        assert 1 <= len(call) <= BATCH
        assert len({e.send_at for e in call}) == 1
        assert sum(e.size for e in call) <= s.max_message_size
    assert [c[0].send_at for c in calls] == sorted(c[0].send_at for c in calls)


def test_a_due_time_before_the_delay_wins() -> None:
    e = make_entry(SQSSettings(), 0, Outgoing(message(due_in=2.0), 3600.0), NOW)
    assert isinstance(e, Entry)
    assert e.visible_at == NOW + 2.0
    assert timedelta(seconds=0) <= timedelta(seconds=e.send_at - NOW) <= timedelta(seconds=1)
