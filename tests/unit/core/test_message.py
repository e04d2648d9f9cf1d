"""duebox.message: the envelope's fields at their exact bounds, the body's
size bound at the broker's limit, and what a message handed to the dedupe
decorator says about its job (``MessageRef``).

Hostile bodies (deep, huge, garbage) are tests/badinput's; the fast encoder
is tests/test_message_encode.py's."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from duebox import JobMessage, MessageDecodeError
from duebox.message import (
    HEADER_ID,
    HEADER_TASK,
    HEADER_VERSION,
    ORDERING_KEY_HEADER,
    TASK_NAME_MAX,
    VERSION_MAX,
    MessageRef,
)
from duebox.states import Discard

JOB = uuid.UUID("0190a0a0-0000-7000-8000-000000000001")
DUE = datetime(2030, 1, 1, 9, tzinfo=UTC)


def message(**changes: Any) -> JobMessage:
    fields: dict[str, Any] = {"job_id": JOB, "task": "send", "queue": "default", "version": 3,
                              "attempt": 0, "due_at": DUE, "payload": {"n": 1}}
    return JobMessage(**{**fields, **changes})


def envelope(**changes: Any) -> dict[str, Any]:
    data = json.loads(message().encode())
    data.update(changes)
    return {k: v for k, v in data.items() if v is not ...}


def refused_field(data: dict[str, Any]) -> str:
    with pytest.raises(MessageDecodeError) as refused:
        JobMessage.from_data(data)
    assert str(refused.value).startswith(refused.value.field + ": ")
    return refused.value.field


@pytest.mark.parametrize(("changes", "field"), [
    ({"format": "duebox/2"}, "format"),
    ({"id": ...}, "id"),
    ({"id": "not-a-uuid"}, "id"),
    ({"version": 0}, "version"),
    ({"version": VERSION_MAX + 1}, "version"),
    ({"version": True}, "version"),
    ({"version": 1.0}, "version"),
    ({"version": "1"}, "version"),
    ({"attempt": -1}, "attempt"),
    ({"attempt": False}, "attempt"),
    ({"task": ""}, "task"),
    ({"task": "t" * (TASK_NAME_MAX + 1)}, "task"),
    ({"task": "a\x00b"}, "task"),
    ({"queue": ""}, "queue"),
    ({"queue": 7}, "queue"),
    ({"due_at": "2030-01-01T09:00:00"}, "due_at"),
    ({"due_at": "tomorrow"}, "due_at"),
    ({"due_at": 1893488400}, "due_at"),
    ({"due_at": ...}, "due_at"),
    ({"headers": [1]}, "headers"),
])
def test_each_field_is_refused_by_name(changes: dict[str, Any], field: str) -> None:
    assert refused_field(envelope(**changes)) == field


def test_the_fields_at_their_bounds_are_taken() -> None:
    msg = JobMessage.from_data(envelope(version=VERSION_MAX, task="t" * TASK_NAME_MAX,
                                        attempt=0, headers=None))
    assert (msg.version, len(msg.task), msg.headers) == (VERSION_MAX, TASK_NAME_MAX, {})


def test_an_offset_due_time_arrives_as_the_same_instant_in_utc() -> None:
    msg = JobMessage.from_data(envelope(due_at="2030-01-01T11:00:00+02:00"))
    assert msg.due_at == DUE
    assert msg.due_at.tzinfo is UTC


def test_any_spelling_of_the_id_is_the_same_job() -> None:
    for spelling in (str(JOB).upper(), JOB.hex, "{" + str(JOB) + "}", f"urn:uuid:{JOB}"):
        assert JobMessage.from_data(envelope(id=spelling)).job_id == JOB


def test_a_body_of_exactly_the_brokers_limit_decodes_one_byte_more_does_not() -> None:
    body = message().encode()
    assert JobMessage.decode(body, max_bytes=len(body)) == message()
    with pytest.raises(MessageDecodeError) as refused:
        JobMessage.decode(body, max_bytes=len(body) - 1)
    assert (refused.value.field, refused.value.reason) == ("body", Discard.TOO_LARGE)
    # A str body counts its UTF-8 bytes, not its characters.
    text = message(payload={"s": "é" * 10}).encode().decode("ascii")
    assert JobMessage.decode(text, max_bytes=len(text.encode()))


def test_the_ordering_key_is_the_header_as_text_else_the_id() -> None:
    assert message().ordering_key() == str(JOB)
    assert message(headers={ORDERING_KEY_HEADER: ""}).ordering_key() == str(JOB)
    assert message(headers={ORDERING_KEY_HEADER: "acct-7"}).ordering_key() == "acct-7"
    assert message(headers={ORDERING_KEY_HEADER: 42}).ordering_key() == "42"


def test_the_header_map_carries_the_envelope_and_only_the_trace_headers() -> None:
    traced = message(headers={"traceparent": "00-ab-cd-01", "tracestate": "k=v",
                              "secret": "not for the broker"},
                     due_at=datetime(2030, 1, 1, 10, tzinfo=timezone(timedelta(hours=1))))
    assert traced.header_map() == {
        "duebox-id": str(JOB), "duebox-version": "3", "duebox-attempt": "0",
        "duebox-due-at": traced.due_at.isoformat(), "duebox-task": "send",
        "traceparent": "00-ab-cd-01", "tracestate": "k=v"}


# --- MessageRef: what the dedupe decorator is handed ----------------------------------------


def test_a_ref_from_the_headers_alone() -> None:
    ref = MessageRef.of({HEADER_ID: str(JOB).encode(), HEADER_VERSION: b"3",
                         HEADER_TASK: "send"}, None)
    assert ref == MessageRef(JOB, 3, "send")
    assert MessageRef.of({HEADER_ID: str(JOB)}, None) == MessageRef(JOB, None, None)
    # AMQP may carry a header as a number.
    assert MessageRef.of({HEADER_ID: str(JOB), HEADER_VERSION: 3}, None).version == 3


def test_a_ref_from_the_body_raw_or_parsed() -> None:
    msg = message()
    assert MessageRef.of({}, msg.encode()) == MessageRef(JOB, 3, "send")
    assert MessageRef.of({}, json.loads(msg.encode())) == MessageRef(JOB, 3, "send")
    assert MessageRef.of(msg.header_map(), msg.encode()) == MessageRef(JOB, 3, "send")


@pytest.mark.parametrize(("headers", "field"), [
    ({}, HEADER_ID),
    ({HEADER_ID: "nope"}, HEADER_ID),
    ({HEADER_ID: b"\xff\xfe"}, HEADER_ID),
    ({HEADER_ID: str(JOB), HEADER_VERSION: "²"}, HEADER_VERSION),  # a digit to isdigit()
    ({HEADER_ID: str(JOB), HEADER_VERSION: "0"}, HEADER_VERSION),
    ({HEADER_ID: str(JOB), HEADER_VERSION: str(VERSION_MAX + 1)}, HEADER_VERSION),
    ({HEADER_ID: str(JOB), HEADER_VERSION: "1" * 13}, HEADER_VERSION),
    ({HEADER_ID: str(JOB), HEADER_VERSION: True}, HEADER_VERSION),
    ({HEADER_ID: str(JOB), HEADER_TASK: "a\x00"}, HEADER_TASK),
])
def test_headers_alone_are_checked_by_name(headers: dict[str, Any], field: str) -> None:
    with pytest.raises(MessageDecodeError) as refused:
        MessageRef.of(headers, None)
    assert refused.value.field == field


@pytest.mark.parametrize(("name", "forged"), [
    (HEADER_ID, str(uuid.UUID(int=JOB.int + 1))), (HEADER_VERSION, "4"), (HEADER_TASK, "refund"),
])
def test_a_header_that_disagrees_with_the_body_is_refused(name: str, forged: str) -> None:
    msg = message()
    with pytest.raises(MessageDecodeError, match="must agree with the body") as refused:
        MessageRef.of({**msg.header_map(), name: forged}, msg.encode())
    assert refused.value.field == name


def test_a_body_that_is_not_a_message_is_refused_even_with_good_headers() -> None:
    with pytest.raises(MessageDecodeError) as refused:
        MessageRef.of(message().header_map(), b'{"format": "duebox/1"}')
    assert refused.value.field == "id"
