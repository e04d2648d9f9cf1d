"""The relay's fast message encoding is the envelope, byte for byte.

``JobMessage.encode`` writes the body field by field (issue #20: building a
dict and running the encoder over it was a third of the encoding's cost);
:meth:`JobMessage._encode_dict` is the plain way.  Every message must come
out the same either way, whatever the payload, the names and the headers,
and must decode back to itself.  The id and due-time texts are made once
per message and shared by the body, the headers and the ordering key.
"""

from __future__ import annotations

import enum
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from duebox.message import (
    STORED_MAX_DEPTH,
    TRACE_HEADERS,
    JobMessage,
    RawJSON,
    UndecodableJSON,
    passed_on,
)

# Text a broker might carry in a name or a payload: NUL, lone surrogates,
# controls, quotes and backslashes, RTL marks, astral characters.
hostile_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
             | st.floats(allow_nan=True, allow_infinity=True) | hostile_text)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(hostile_text, inner, max_size=4), max_leaves=20)
instants = st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(8999, 12, 31),
                        timezones=st.just(UTC))


@settings(max_examples=400, deadline=None)
@given(task=hostile_text.filter(bool), queue=hostile_text.filter(bool), payload=json_value,
       headers=st.dictionaries(hostile_text, json_value, max_size=4),
       version=st.integers(min_value=1, max_value=2**62),
       attempt=st.integers(min_value=0, max_value=2**62), due=instants)
def test_the_fast_body_is_the_dict_body(task: str, queue: str, payload: object,
                                        headers: dict[str, object], version: int, attempt: int,
                                        due: datetime) -> None:
    msg = JobMessage(uuid.uuid4(), task, queue, version, attempt, due, payload, headers)
    fast = msg.encode()
    assert fast == JobMessage(msg.job_id, task, queue, version, attempt, due, payload,
                              headers)._encode_dict()
    back = json.loads(fast)
    assert back["id"] == str(msg.job_id)
    assert back["task"] == task
    assert back["queue"] == queue


def test_a_body_decodes_to_the_message() -> None:
    due = datetime(2031, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)
    msg = JobMessage(uuid.uuid4(), 'send "it"\n', "q\\1", 3, 2, due, {"a": [1, 2.5, None]},
                     {"ordering_key": "k", "traceparent": "00-ab-cd-01"})
    assert JobMessage.decode(msg.encode()) == msg


class Version(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize("odd", [{"version": True}, {"version": Version.ONE},
                                 {"attempt": False}])
def test_values_of_other_types_take_the_plain_encoder(odd: dict[str, object]) -> None:
    """A bool or an int subclass where an int belongs is written as the JSON
    encoder writes it (``true``, ``1``), never as ``str()`` would."""
    fields = {"version": 1, "attempt": 0, **odd}
    msg = JobMessage(uuid.uuid4(), "t", "q", due_at=datetime.now(UTC), **fields)  # type: ignore[arg-type]
    assert msg.encode() == msg._encode_dict()
    assert json.loads(msg.encode())["version"] == json.loads(json.dumps(fields["version"]))


def test_texts_are_made_once_and_agree_everywhere() -> None:
    due = datetime.now(UTC) + timedelta(seconds=5)
    msg = JobMessage(uuid.uuid4(), "t", "q", 1, 0, due, None,
                     {name: f"v-{name}" for name in TRACE_HEADERS})
    headers = msg.header_map()
    assert headers["duebox-id"] == msg.id_text == msg.ordering_key() == str(msg.job_id)
    assert headers["duebox-due-at"] == due.isoformat()
    assert headers["duebox-version"] == "1"
    assert headers["duebox-attempt"] == "0"
    assert headers["duebox-task"] == "t"
    assert {k: headers[k] for k in TRACE_HEADERS} == {k: f"v-{k}" for k in TRACE_HEADERS}
    assert json.loads(msg.encode())["due_at"] == due.isoformat()
    # The cache is not part of what a message is: equal messages stay equal.
    fresh = JobMessage(msg.job_id, "t", "q", 1, 0, due, None, dict(msg.headers))
    assert fresh == msg
    assert "_texts" not in repr(msg)


def test_no_trace_headers_without_a_trace() -> None:
    msg = JobMessage(uuid.uuid4(), "t", "q", 1, 0, datetime.now(UTC), None,
                     {"ordering_key": "k"})
    assert set(msg.header_map()) == {"duebox-id", "duebox-version", "duebox-attempt",
                                     "duebox-due-at", "duebox-task"}
    assert msg.ordering_key() == "k"


# --- payloads handed on as PostgreSQL stored them (message.passed_on) ------------


@settings(max_examples=200, deadline=None)
@given(payload=json_value.filter(lambda v: not _has_nan(v)))
def test_a_stored_payload_is_handed_on_unparsed_and_decodes_the_same(payload: object) -> None:
    """The text jsonb gives (here: any JSON text with jsonb's spacing) goes
    into the body as it is; the worker decodes the same value from it."""
    text = json.dumps(payload, separators=(", ", ": "), ensure_ascii=False)
    # jsonb holds UTF-8 text only: it refuses lone surrogates on input.
    assume(not any(0xD800 <= ord(c) <= 0xDFFF for c in text))
    handed = passed_on(text)
    if payload is None:
        assert handed is None
        return
    assert isinstance(handed, RawJSON)
    msg = JobMessage(uuid.uuid4(), "t", "q", 1, 0, datetime.now(UTC), handed, {})
    assert JobMessage.decode(msg.encode()).payload == payload
    assert json.loads(msg._encode_dict())["payload"] == payload


def _has_nan(value: object) -> bool:
    if isinstance(value, float):
        return value != value or value in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return any(_has_nan(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nan(v) for v in value.values())
    return False


def test_payloads_a_worker_could_not_decode_are_parsed_as_before() -> None:
    """Too deep for the worker's decode, or a number too long for json.loads:
    parsed as the claim always did, which makes such a hand-written row an
    UndecodableJSON that the worker dead-letters with its reason, instead of
    a body no worker can read."""
    deep = "[" * (STORED_MAX_DEPTH + 1) + "]" * (STORED_MAX_DEPTH + 1)
    assert isinstance(passed_on(deep), UndecodableJSON)
    long_number = '{"n": ' + "7" * 5000 + "}"
    assert isinstance(passed_on(long_number), UndecodableJSON)
    # Long but harmless: still handed on as it is.
    wide = json.dumps({"xs": list(range(300)), "s": "9" * 639})
    assert isinstance(passed_on(wide), RawJSON)
    assert passed_on("null") is None
    assert passed_on(None) is None
