"""Packs of due jobs in one RabbitMQ message (brokers/amqp_pack.py), without
a broker: which jobs share a message, the pack's body, its decoding bound
against hostile bodies, and when a pack's message may be settled.  The
real-broker behaviour is in tests/test_amqp_broker.py and
tests/badinput/test_hostile_brokers.py."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hostile import GARBAGE, deep_json
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox.brokers import amqp_pack
from duebox.brokers.amqp_pack import MAX_PACK_JOBS, PACK_BYTES, Pack
from duebox.errors import MessageDecodeError
from duebox.message import PAYLOAD_MAX_DEPTH, JobMessage
from duebox.seam import Outgoing


def job(queue: str = "q", payload: object = None, **kw: object) -> JobMessage:
    return JobMessage(job_id=uuid.uuid4(), task="t", queue=queue, version=1, attempt=0,
                      due_at=datetime.now(UTC), payload=payload, headers=dict(kw))


def plan(batch: list[Outgoing], most: int = 32, own: tuple[str, ...] = ()) -> list[list[int]]:
    bodies = [o.message.encode() if o.delay <= 0 and o.message.queue not in own else None
              for o in batch]
    return amqp_pack.units(batch, bodies, most, own)


def test_due_jobs_of_a_queue_share_messages_in_order() -> None:
    batch = [Outgoing(job("a"), 0.0), Outgoing(job("b"), 0.0), Outgoing(job("a"), 2.0),
             Outgoing(job("a"), 0.0), Outgoing(job("a"), -1.0), Outgoing(job("b"), 0.0)]
    assert plan(batch, most=2) == [[0, 3], [1, 5], [2], [4]]


def test_delayed_jobs_own_queues_and_pack_1_go_alone() -> None:
    batch = [Outgoing(job("a"), 0.0), Outgoing(job("mine"), 0.0), Outgoing(job("mine"), 0.0),
             Outgoing(job("a"), 0.0)]
    assert plan(batch, own=("mine",)) == [[0, 3], [1], [2]]
    assert plan(batch, most=1) == [[0], [1], [2], [3]]


def test_a_pack_stays_under_its_byte_bound() -> None:
    big = "x" * (PACK_BYTES // 3)
    batch = [Outgoing(job("a", big), 0.0) for _ in range(7)]
    units = plan(batch)
    assert [len(u) for u in units] == [2, 2, 2, 1]
    for unit in units:
        body = amqp_pack.encode([batch[i].message.encode() for i in unit])
        assert len(body) <= PACK_BYTES


def test_a_pack_decodes_to_its_jobs_exactly() -> None:
    jobs = [job("a", {"n": i, "deep": [[[i]]]}, ordering_key="k") for i in range(5)]
    jobs[2] = JobMessage(job_id=jobs[2].job_id, task="t", queue="a", version=3, attempt=2,
                         due_at=datetime.now(UTC) - timedelta(hours=1), payload="text")
    body = amqp_pack.encode([m.encode() for m in jobs])
    assert amqp_pack.decode(body) == jobs


def test_a_payload_at_the_depth_limit_still_decodes_in_a_pack() -> None:
    """schedule() accepts payloads nested PAYLOAD_MAX_DEPTH deep; the pack's
    own two levels must not make such a job undecodable."""
    deep: object = 0
    for _ in range(PAYLOAD_MAX_DEPTH - 1):
        deep = [deep]
    m = job("a", deep)
    assert amqp_pack.decode(amqp_pack.encode([m.encode()])) == [m]


@pytest.mark.parametrize(("body", "field"), [
    (b"", "body"),
    (b"[]", "format"),
    (b'{"format": "duebox/1", "jobs": []}', "format"),
    (b'{"format": "duebox-pack/1"}', "jobs"),
    (b'{"format": "duebox-pack/1", "jobs": []}', "jobs"),
    (b'{"format": "duebox-pack/1", "jobs": {"a": 1}}', "jobs"),
    (('{"format": "duebox-pack/1", "jobs": [' + ",".join(["{}"] * (MAX_PACK_JOBS + 1))
      + "]}").encode(), "jobs"),
    (deep_json(40_000), "body"),
])
def test_a_pack_that_does_not_decode_names_the_field(body: bytes, field: str) -> None:
    with pytest.raises(MessageDecodeError) as caught:
        amqp_pack.decode(body)
    assert caught.value.field == field


def test_a_pack_over_the_brokers_limit_is_refused_unparsed() -> None:
    with pytest.raises(MessageDecodeError, match="at most 100 bytes") as caught:
        amqp_pack.decode(b'{"format": "duebox-pack/1", "jobs": [' + b" " * 200 + b"]}", 100)
    assert caught.value.reason == "too_large"


def test_an_envelope_that_does_not_decode_is_its_own_refusal() -> None:
    good = job("a")
    body = (b'{"format": "duebox-pack/1", "jobs": [' + good.encode() + b', 42, {"format": '
            b'"duebox/1", "id": "nope"}, ' + good.encode() + b"]}")
    first, number, bad_id, again = amqp_pack.decode(body)
    assert first == good == again  # a copy twice: the worker's version check sorts it out
    assert isinstance(number, MessageDecodeError)
    assert isinstance(bad_id, MessageDecodeError)
    assert bad_id.field == "id"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.sampled_from([raw for raw, _ in GARBAGE]))
def test_any_body_decodes_or_is_refused_never_raises_anything_else(body: bytes) -> None:
    for wrapped in (body, b'{"format": "duebox-pack/1", "jobs": [' + body + b"]}"):
        try:
            out = amqp_pack.decode(wrapped)
        except MessageDecodeError:
            continue
        assert all(isinstance(m, JobMessage | MessageDecodeError) for m in out)
        json.dumps([str(m) for m in out])


def test_a_packs_message_is_acked_once_every_job_is_settled() -> None:
    pack = Pack(3)
    assert pack.settle(1) is None
    assert pack.settle(1) is None  # settling one twice changes nothing
    assert pack.settle(0) is None
    assert pack.settle(2) == "ack"
    assert pack.settle(2) is None  # already settled: nothing more to do


def test_a_pack_given_back_before_anything_of_it_ran_is_requeued() -> None:
    pack = Pack(2)
    assert pack.settle(0, job(), handled=False) is None
    assert pack.settle(1, job(), handled=False) == "requeue"


def test_a_pack_partly_handled_republishes_what_was_given_back() -> None:
    """Its finished jobs must not come back: the jobs never handled are
    published again and the pack acked."""
    pack = Pack(4)
    kept = [job(), job()]
    assert pack.settle(0) is None
    assert pack.settle(1, kept[0], handled=False) is None
    assert pack.settle(3, None, handled=False) is None  # an envelope that did not decode
    assert pack.settle(2, kept[1], handled=False) == "republish"
    assert pack.given_back == kept
