"""Hostile values for the bad-input suite's hypothesis tests: text a
database cannot store or a terminal would obey, numbers at every edge,
containers JSON does not carry back, nesting from just under duebox's limit
to 100,000 levels, bodies of megabytes, and instants and durations past both
ends of the calendar.  ``PLAIN`` is the other side: values that must always
be accepted and come back equal (duebox.validation has the rule)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

from duebox.validation import EARLIEST, LATEST, MAX_DEPTH

MB = 1024 * 1024


def nested(depth: int, leaf: Any = 1) -> Any:
    """``depth`` lists and dicts, alternating, around ``leaf``."""
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


NASTY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12) | st.lists(
    st.sampled_from(["\x00", "\ud800", "\udc80", "\x1b[2J", "\n", "\u202e", "\u200f",
                     "\ufeff", "e\u0301", "\u00e9", "\u2028", "\x7f", "\U0001d518",
                     "\\u0000", '"', "\\", " "]), max_size=4).map("".join)
NASTY_NUMBERS = (st.integers() | st.floats() | st.booleans() | st.sampled_from([
    -0.0, 1e16, -1e16, 9.999999999999998e15, 1e-320, 5e-324, 2**53 + 1, 10**400,
    Decimal("1.1"), math.pi, 1e308, "123", "1e16", "NaN"])
    # Past 4,300 digits an int has no JSON text (nor a repr): built, not listed.
    | st.integers(4_290, 4_310).map(lambda n: 10**n))
NASTY_KEYS = NASTY_TEXT | st.integers() | st.booleans() | st.none() | st.floats() | st.tuples(
    st.integers())
NASTY = st.recursive(
    st.none() | NASTY_NUMBERS | NASTY_TEXT | st.binary(max_size=4),
    lambda children: (st.lists(children, max_size=4)
                      | st.dictionaries(NASTY_KEYS, children, max_size=4)
                      | st.tuples(children, children)
                      | st.frozensets(st.integers(), max_size=2)),
    max_leaves=20,
) | st.integers(MAX_DEPTH - 2, 1_500).map(nested) | st.sampled_from(
    ["x" * (3 * MB), ["y" * 1000] * (5 * 1024), nested(MAX_DEPTH), nested(MAX_DEPTH + 1),
     nested(100_000)])

PLAIN_TEXT = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)),
                     max_size=12)
PLAIN_FLOATS = st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: abs(f) < 1e16)
PLAIN_CONTAINERS = st.recursive(
    st.none() | st.booleans() | st.integers() | PLAIN_FLOATS | PLAIN_TEXT,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(PLAIN_TEXT, children, max_size=4),
    max_leaves=20,
).filter(lambda v: isinstance(v, list | dict))
# The whole payload may also be a scalar; a number there must be a 64-bit
# int or have a fraction (SQLite's JSON column rewrites others).
PLAIN = (PLAIN_CONTAINERS | st.none() | st.booleans() | PLAIN_TEXT
         | st.integers(-(2**63), 2**63 - 1)
         | PLAIN_FLOATS.filter(lambda f: not f.is_integer()))

US = timedelta(microseconds=1)
NASTY_INSTANTS = st.datetimes(
    timezones=st.none() | st.timezones() | st.just(UTC)) | st.sampled_from([
    datetime(1, 1, 1, tzinfo=UTC), datetime.max.replace(tzinfo=UTC), datetime(9999, 12, 31),
    datetime(9999, 12, 31, 23, tzinfo=timezone(-timedelta(hours=5))),
    datetime(1, 1, 1, 1, tzinfo=timezone(timedelta(hours=5))),
    EARLIEST, EARLIEST - US, LATEST, LATEST - US])
NASTY_DURATIONS = st.timedeltas() | st.floats() | st.integers(-(10**30), 10**500) | (
    st.sampled_from([timedelta.max, timedelta.min, -US, 10**400, math.nan, -0.0, True, "5",
                     Decimal("5"), None]))
