"""The decoding boundary against hostile bodies: nesting far past the
parser's recursion limit, bodies larger than the broker carries, NUL, lone
surrogates and control characters, strings full of brackets.  Decoding
either returns a message that encodes back to itself or raises
:class:`MessageDecodeError` naming the field and the discard reason — never
anything else (a ``RecursionError`` out of ``JobMessage.decode`` stopped
every worker of a queue), and a delivery is made of any body whatsoever."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hostile import GARBAGE, deep_json, envelope
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duebox import JobMessage, MessageDecodeError
from duebox.brokers.base import delivery_from_body
from duebox.message import (
    MAX_JSON_DEPTH,
    PAYLOAD_MAX_DEPTH,
    STORED_MAX_DEPTH,
    UndecodableJSON,
    lenient_json,
    too_deep,
)

from .common import GOOD, decode_or_field


def nested(depth: int, shape: str, filler: str = "") -> str:
    """JSON text nesting ``depth`` levels, opening with ``shape`` (a cycle of
    ``[`` and ``{``), with ``filler`` (a JSON string) innermost."""
    opens, closes = [], []
    for i in range(depth):
        if shape[i % len(shape)] == "[":
            opens.append("[")
            closes.append("]")
        else:
            opens.append('{"k":')
            closes.append("}")
    inner = filler or "0"
    return "".join(opens) + inner + "".join(reversed(closes))


# Strings with the characters that trip scanners: brackets, quotes,
# escapes, NUL, lone surrogates, control characters, RTL marks.
TRICKY = st.text(alphabet=st.sampled_from(list('[]{}"\\\x00\x1b\n\r\u202e\ud800\udfffa')),
                 max_size=40)
SHAPES = st.text(alphabet="[{", min_size=1, max_size=5)


def reference_depth(value: Any) -> int:
    """The nesting depth of a parsed value, counted the obvious way."""
    depth, level = 0, [(value, 1)]
    while level:
        item, d = level.pop()
        if isinstance(item, list | dict):
            depth = max(depth, d)
            level.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return depth


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 6000), shape=SHAPES, filler=TRICKY)
def test_the_depth_scan_agrees_with_the_parser(depth: int, shape: str, filler: str) -> None:
    """too_deep() counts exactly the levels json.loads would recurse into,
    whatever brackets and escapes the strings inside hold."""
    text = nested(depth, shape, json.dumps(filler))
    for limit in (depth - 1, depth):
        assert too_deep(text, limit) == (depth > limit)
    if depth < 500:  # the parser itself stops near 1,000
        assert reference_depth(json.loads(text)) == depth


@settings(max_examples=100, deadline=None)
@given(depth=st.integers(MAX_JSON_DEPTH, 20_000), shape=SHAPES,
       where=st.sampled_from(["body", "payload", "headers", "id", "task", "extra"]))
def test_deep_nesting_anywhere_is_refused_before_parsing(depth: int, shape: str,
                                                         where: str) -> None:
    """Nested past the limit as the whole body or inside any field (the
    envelope adds a level): refused as ``too_deep``, naming the body."""
    if where == "body":
        raw = nested(depth + 1, shape)
    else:  # spliced as text: json.dumps itself cannot encode 20,000 levels
        fields = json.dumps({k: v for k, v in GOOD.items() if k != where})
        raw = fields[:-1] + f', "{where}": ' + nested(depth, shape) + "}"
    with pytest.raises(MessageDecodeError) as info:
        JobMessage.decode(raw.encode())
    assert (info.value.field, info.value.reason) == ("body", "too_deep")


@pytest.mark.parametrize("levels", [1_000, 10_000, 1_000_000])
def test_bodies_nested_past_the_recursion_limit_become_rejectable_deliveries(
        levels: int) -> None:
    for raw in (deep_json(levels), b"[" * levels, b'{"a":' * levels):
        delivery = delivery_from_body(raw)
        assert delivery.message is None
        assert delivery.decode_reason == "too_deep"
        assert delivery.decode_error is not None
        assert len(delivery.decode_error) < 300


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, PAYLOAD_MAX_DEPTH), shape=SHAPES, filler=TRICKY)
def test_a_payload_nested_as_deep_as_schedule_allows_decodes(depth: int, shape: str,
                                                             filler: str) -> None:
    """Everything a producer may schedule still decodes at the worker (the
    envelope adds one level)."""
    payload = json.loads(nested(depth, shape, json.dumps(filler)))
    msg = JobMessage.decode(envelope(payload=payload))
    assert msg.payload == payload
    assert JobMessage.decode(msg.encode()) == msg


def test_schedule_refuses_a_payload_the_worker_could_not_decode(bare_app: Any) -> None:
    from duebox.errors import ValidationError

    too_deep_payload = json.loads(nested(PAYLOAD_MAX_DEPTH + 1, "[{"))
    for field in ("payload", "headers"):
        kw = {"headers": {"h": too_deep_payload}} if field == "headers" else {}
        with pytest.raises(ValidationError) as info:
            bare_app.new_job("t", too_deep_payload if field == "payload" else None, **kw)
        assert info.value.field == field
        assert "levels deep" in info.value.rule


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(0, 4_000_000), limit=st.integers(1024, 3_000_000),
       head=st.sampled_from([b"", b"{", b"[", b'"', b"\xff", b"\x00"]))
def test_a_body_larger_than_the_broker_carries_is_refused_unread(size: int, limit: int,
                                                                 head: bytes) -> None:
    raw = head + b"x" * size
    delivery = delivery_from_body(raw, max_bytes=limit)
    assert delivery.message is None
    assert delivery.decode_reason == ("too_large" if len(raw) > limit else "undecodable")
    assert delivery.decode_error is not None
    assert len(delivery.decode_error) < 300


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=5000) | st.sampled_from([raw for raw, _ in GARBAGE])
       | st.text(alphabet=st.characters(codec=None), max_size=300).map(
           lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_bytes_become_a_delivery_never_an_exception(raw: bytes) -> None:
    delivery = delivery_from_body(raw)
    if delivery.message is None:
        assert delivery.decode_reason in ("undecodable", "too_deep", "too_large")
    else:
        assert JobMessage.decode(delivery.message.encode()) == delivery.message


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(["task", "queue", "id", "due_at", "format"]), value=TRICKY)
def test_nul_surrogates_and_control_characters_in_fields(field: str, value: str) -> None:
    """Decoded as the text JSON says it is (a lone surrogate travels as its
    escape; an escaped pair is one character), or refused naming the field."""
    raw = json.dumps({**GOOD, field: value}).encode()
    msg = decode_or_field(raw)
    if isinstance(msg, str):
        assert msg == field
        return
    assert getattr(msg, field) == json.loads(json.dumps(value))
    assert JobMessage.decode(msg.encode()) == msg


def test_a_stored_value_nested_too_deep_reads_as_undecodable_not_an_exception() -> None:
    """A row written by hand (sql:// reads rows, not messages) must not make
    the claim raise: it dead-letters with the reason instead."""
    for text in (deep_json(5000).decode(), "[" * 5000, nested(STORED_MAX_DEPTH + 1, "{")):
        assert isinstance(lenient_json(text), UndecodableJSON)
    assert lenient_json(nested(STORED_MAX_DEPTH, "[{")) == json.loads(
        nested(STORED_MAX_DEPTH, "[{"))
