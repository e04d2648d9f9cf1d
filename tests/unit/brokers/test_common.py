"""duebox.brokers._common: the one parser of every backend's URL numbers
and flags, whose refusals name the parameter and the rule."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox import ConfigurationError
from duebox.brokers._common import flag, name_param, number, refuse_unknown, safe_token


def test_a_number_within_its_bounds_or_the_default() -> None:
    assert number({}, "wait", 10, low=0, high=20) == 10
    assert number({"wait": "20"}, "wait", 10, low=0, high=20) == 20.0
    assert number({"wait": "0"}, "wait", 10, low=0) == 0.0
    assert number({"t": "1e3"}, "t", 1, low=0, integer=True) == 1000.0
    assert number({"t": "0.001"}, "t", 1, low=0, above=True) == 0.001


@pytest.mark.parametrize(("raw", "kw", "rule"), [
    ("-1", {"low": 0}, "broker_url: n must be a number >= 0 (got '-1')"),
    ("21", {"low": 0, "high": 20}, "broker_url: n must be a number >= 0 and <= 20 (got '21')"),
    ("0", {"low": 0, "above": True}, "broker_url: n must be a number > 0 (got '0')"),
    ("1.5", {"low": 1, "integer": True}, "broker_url: n must be an integer >= 1 (got '1.5')"),
    ("nan", {"low": 0}, "broker_url: n must be a number >= 0 (got 'nan')"),
    ("inf", {"low": 0}, "broker_url: n must be a number >= 0 (got 'inf')"),
    ("", {"low": 0, "seconds": True}, "broker_url: n must be a number of seconds >= 0 (got '')"),
    ("ten", {"low": 0.1, "seconds": True},
     "broker_url: n must be a number of seconds >= 0.1 (got 'ten')"),
])
def test_a_bad_number_names_the_parameter_and_the_rule(raw: str, kw: dict[str, object],
                                                       rule: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        number({"n": raw}, "n", 1.0, **kw)  # type: ignore[arg-type]
    assert str(refused.value) == rule


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12) | st.floats().map(repr) | st.integers().map(str))
def test_any_text_is_a_number_in_bounds_or_refused(raw: str) -> None:
    refused: ConfigurationError | None = None
    try:
        value = number({"n": raw}, "n", 5.0, low=1, high=100, integer=True)
    except ConfigurationError as exc:
        refused = exc
    if refused is not None:
        assert str(refused).startswith("broker_url: n must be an integer >= 1 and <= 100")
    else:
        assert math.isfinite(value)
        assert 1 <= value <= 100
        assert value == int(value)


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("TRUE", True), ("yes", True), ("On", True),
    ("0", False), ("false", False), ("NO", False), ("off", False),
])
def test_flags_in_any_case(raw: str, value: bool) -> None:
    assert flag({"f": raw}, "f", not value) is value


@pytest.mark.parametrize("raw", ["", "2", "y", "enabled"])
def test_a_bad_flag_names_the_parameter(raw: str) -> None:
    with pytest.raises(ConfigurationError, match=f"^broker_url: f must be true or false "
                                                 f"\\(got '{raw}'\\)"):
        flag({"f": raw}, "f", True)
    assert flag({}, "f", True) is True


def test_a_name_parameter_matches_its_pattern_whole() -> None:
    assert name_param({}, "prefix", "duebox-", r"[a-z-]{0,10}", "r") == "duebox-"
    with pytest.raises(ConfigurationError,
                       match=r"^broker_url: prefix must be short \(got 'a/b'\)"):
        name_param({"prefix": "a/b"}, "prefix", "x", r"[a-z]+", "short")
    with pytest.raises(ConfigurationError):
        name_param({"prefix": "ab\n"}, "prefix", "x", r"[a-z]+", "short")


def test_a_misspelt_parameter_is_named_with_the_known_ones() -> None:
    refuse_unknown({"prefix": "a"}, frozenset({"prefix", "wait"}), "sqs")
    with pytest.raises(ConfigurationError) as refused:
        refuse_unknown({"prefx": "a", "zz": "b"}, frozenset({"prefix", "wait"}), "sqs")
    assert str(refused.value) == ("broker_url: unknown parameter 'prefx' for sqs:// "
                                  "(known: prefix, wait)")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_a_safe_token_is_the_value_when_allowed_else_its_stable_digest(value: str) -> None:
    token = safe_token(value)
    assert token == safe_token(value)
    assert 1 <= len(token) <= 128
    assert token.isascii()
    assert token.isprintable()
    assert " " not in token
    if token != value:
        assert token == hashlib.sha256(value.encode()).hexdigest()
