"""duebox.validation: what duebox stores for a caller is kept exactly as given,
or refused naming the field and the rule.

The JSON rule is checked against a reference written the obvious way (a
recursive walk over the module docstring's list), on any value hypothesis
builds: ``check_json`` refuses exactly what the reference refuses, and what
it accepts comes back equal through JSON text."""

from __future__ import annotations

import enum
import json
import math
import unicodedata
from collections import OrderedDict
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox import ValidationError
from duebox.validation import (
    EARLIEST,
    FLOAT_LIMIT,
    LATEST,
    MAX_DEPTH,
    MAX_SPAN,
    aware,
    check_json,
    check_operator,
    check_optional_str,
    check_printable,
    check_span,
    check_text,
    encode_json,
    seconds_of,
    shown,
    text_problem,
)

_UNPRINTABLE = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def faithful(value: Any, depth: int = 0, bare: bool = True) -> bool:
    """The module docstring's JSON rule, written plainly (recursively)."""
    if bare and type(value) is float and value.is_integer():
        return False
    if bare and isinstance(value, int) and not isinstance(value, bool) \
            and not -(2**63) <= value < 2**63:
        return False
    if value is None or isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value) and abs(value) < FLOAT_LIMIT
    if isinstance(value, str):
        return "\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list | dict) and depth >= MAX_DEPTH:
        return False
    if isinstance(value, list):
        return all(faithful(v, depth + 1, False) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and faithful(k, depth, False)
                   and faithful(v, depth + 1, False) for k, v in value.items())
    return False  # tuples, sets, bytes, Decimal, ...


TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=8) | \
    st.sampled_from(["a\x00b", "x\ud800", "\udfff", "ok", ""])
LEAVES = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2)
          | st.floats(allow_nan=True, allow_infinity=True)
          | st.sampled_from([1.0, -0.0, 1e16, 9.99e15, -1e16, 2**64, -(2**63)]) | TEXT)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (st.lists(inner, max_size=3)
                   | st.tuples(inner)
                   | st.dictionaries(TEXT | st.integers(), inner, max_size=3)),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_check_json_refuses_exactly_what_would_not_come_back_equal(value: Any) -> None:
    if faithful(value):
        check_json(value, "payload")
        assert json.loads(encode_json(value)) == value
    else:
        with pytest.raises(ValidationError) as refused:
            check_json(value, "payload")
        assert refused.value.field == "payload"


def nested(levels: int) -> Any:
    value: Any = 0
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def test_depth_is_counted_in_lists_and_dicts_to_the_limit_exactly() -> None:
    check_json(nested(MAX_DEPTH), "payload")
    with pytest.raises(ValidationError, match=f"at most {MAX_DEPTH} levels"):
        check_json(nested(MAX_DEPTH + 1), "payload")


def test_a_refusal_says_where_inside_the_value() -> None:
    with pytest.raises(ValidationError) as refused:
        check_json({"a": [1, {"b": math.nan}]}, "headers")
    assert str(refused.value).startswith("headers: headers['a'][1]['b']: must be a finite")
    with pytest.raises(ValidationError, match=r"payload\[0\]: .*not tuple \(it would come back "
                                              r"as a list\)"):
        check_json([(1, 2)], "payload")
    with pytest.raises(ValidationError, match=r"dict keys must be strings .*\"1\""):
        check_json({1: "a"}, "payload")
    with pytest.raises(ValidationError,
                       match=r"payload\['x'\]\['a\\x00'\]: key must not contain NUL"):
        check_json({"x": {"a\x00": 1}}, "payload")


@pytest.mark.parametrize(("value", "accepted"), [
    (1.0, False), ([1.0], True), (1.5, True), (2**63, False), ([2**63], True),
    (2**63 - 1, True), (-(2**63), True), (-(2**63) - 1, False), (True, True),
])
def test_bare_numbers_follow_sqlites_reading(value: Any, accepted: bool) -> None:
    if accepted:
        check_json(value, "payload")
    else:
        with pytest.raises(ValidationError, match=r"bare .*wrap it in a list or dict"):
            check_json(value, "payload")


class Colour(enum.StrEnum):
    RED = "red"


class Size(enum.IntEnum):
    BIG = 3


def test_subclasses_of_json_types_pass_and_arrive_as_their_base_type() -> None:
    value = OrderedDict(colour=Colour.RED, size=[Size.BIG])
    check_json(value, "payload")
    assert json.loads(encode_json(value)) == {"colour": "red", "size": [3]}


def test_encode_json_refuses_what_has_no_json_text_naming_the_field() -> None:
    deep: Any = []
    for _ in range(100_000):  # past the interpreter's recursion limit
        deep = [deep]
    with pytest.raises(ValidationError, match=f"^headers: must nest .* {MAX_DEPTH} levels"):
        encode_json(deep, "headers")
    with pytest.raises(ValidationError, match=r"^payload: must be JSON-serialisable"):
        encode_json({1, 2})
    with pytest.raises(ValidationError, match=r"^payload: must be JSON-serialisable"):
        encode_json(math.inf)
    assert encode_json({"a": [1, "é"]}) == '{"a":[1,"\\u00e9"]}'


@pytest.mark.parametrize(("text", "problem"), [
    ("plain", None), ("é and 日本", None), ("\x1b[31m\n", None),
    ("ab\x00", "must not contain NUL (U+0000, at index 2)"),
    ("é\ud800", "must not contain a lone surrogate (U+D800, at index 1)"),
])
def test_text_problem_names_the_character_and_where(text: str, problem: str | None) -> None:
    found = text_problem(text)
    if problem is None:
        assert found is None
        assert check_text("key", text) == text
    else:
        assert found is not None
        assert found.startswith(problem)
        with pytest.raises(ValidationError) as refused:
            check_text("key", text)
        assert refused.value.field == "key"


@pytest.mark.parametrize("value", ["", "x" * 11, 5, b"bytes", "a\x00"])
def test_check_optional_str_refuses_by_field(value: object) -> None:
    with pytest.raises(ValidationError) as refused:
        check_optional_str("tenant", value, 10)
    assert refused.value.field == "tenant"


def test_check_optional_str_takes_none_and_a_fitting_string() -> None:
    check_optional_str("tenant", None, 10)
    check_optional_str("tenant", "x" * 10, 10)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12) | st.sampled_from(["a\nb", "\u202eevil", "\x1b[2J", "a\u2028b",
                                               "nb\u00a0sp", "zw\u200bj"]))
def test_shown_escapes_exactly_what_check_printable_refuses(text: str) -> None:
    seen = shown(text)
    assert not any(unicodedata.category(c) in _UNPRINTABLE for c in seen)
    refused: ValidationError | None = None
    try:
        check_printable("reason", text)
    except ValidationError as exc:
        refused = exc
    if refused is not None:
        assert refused.field == "reason"
        assert seen != text
    else:
        assert seen == text


def test_shown_writes_escapes_not_the_characters() -> None:
    assert shown("a\nb\x1b[0m\u202e") == "a\\nb\\x1b[0m\\u202e"


def test_aware_takes_any_zone_and_gives_utc() -> None:
    at = datetime(2030, 6, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    assert aware("at", at) == datetime(2030, 6, 1, 10, tzinfo=UTC)
    assert aware("at", at).tzinfo is UTC


@pytest.mark.parametrize("value", [
    EARLIEST, LATEST - timedelta(microseconds=1),
    datetime(1970, 1, 1, 1, tzinfo=timezone(timedelta(hours=1))),  # the epoch, in +01:00
])
def test_aware_takes_the_range_inclusive_at_the_start(value: datetime) -> None:
    assert aware("at", value) == value


@pytest.mark.parametrize(("value", "rule"), [
    (datetime(2030, 1, 1), "must be timezone-aware"),
    ("2030-01-01T00:00:00+00:00", "must be a timezone-aware datetime"),
    (LATEST, r"up to \(not including\) 9000-01-01"),
    (EARLIEST - timedelta(microseconds=1), "must be from 1970-01-01"),
    (datetime.max.replace(tzinfo=timezone(timedelta(hours=-5))), "must be from 1970-01-01"),
    (datetime.min.replace(tzinfo=timezone(timedelta(hours=5))), "must be from 1970-01-01"),
])
def test_aware_refuses_naming_the_field(value: object, rule: str) -> None:
    with pytest.raises(ValidationError, match=rule) as refused:
        aware("due_at", value)
    assert refused.value.field == "due_at"


@pytest.mark.parametrize(("value", "seconds"), [
    (timedelta(minutes=1, microseconds=5), 60.000005), (0, 0.0), (2.5, 2.5), (10**6, 1e6),
])
def test_seconds_of_takes_timedeltas_and_numbers(value: object, seconds: float) -> None:
    assert seconds_of("delay", value) == seconds


@pytest.mark.parametrize("value", [-1, timedelta(seconds=-1), math.nan, math.inf, 10**400, True,
                                   "5", None])
def test_seconds_of_refuses_naming_the_field(value: object) -> None:
    with pytest.raises(ValidationError) as refused:
        seconds_of("delay", value)
    assert refused.value.field == "delay"


def test_check_span_allows_max_span_and_no_more() -> None:
    most = MAX_SPAN.total_seconds()
    assert check_span("max_lateness", most) == most
    with pytest.raises(ValidationError, match=f"at most {MAX_SPAN.days} days"):
        check_span("max_lateness", most + 1)


def test_check_operator_gives_both_stripped() -> None:
    assert check_operator("  ana ", " cleanup\t") == ("ana", "cleanup")


@pytest.mark.parametrize(("operator", "reason", "field"), [
    (None, "r", "operator"), ("   ", "r", "operator"), ("x" * 201, "r", "operator"),
    ("ana", "", "reason"), ("ana", 7, "reason"), ("ana", "y" * 2001, "reason"),
    ("ana\nroot", "r", "operator"), ("ana", "ok\x1b[2K forged line", "reason"),
    ("ana\u202e", "r", "operator"), ("ana", "a\u2028b", "reason"),
])
def test_check_operator_refuses_by_field(operator: object, reason: object, field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        check_operator(operator, reason)
    assert refused.value.field == field
