"""What duebox stores for a caller, and the rules that keep it exactly as given.

Checked at the API, before any SQL: a refusal is a :class:`ValidationError`
naming the field, never a driver error.  That matters most on PostgreSQL,
where the first failed statement aborts the caller's whole transaction and
its COMMIT then silently rolls back the business write beside the job.

**Text** (keys, tenants, task and schedule names, operator input, and every
string inside a payload or headers, dict keys included) holds no NUL (U+0000:
PostgreSQL's ``text`` and ``jsonb`` cannot store it) and no lone surrogate
(U+D800..U+DFFF: not encodable as the UTF-8 every driver sends).  Anything
else, control characters, bidi marks and unnormalised forms included, is
stored and handed back unchanged.

**JSON** (payloads, headers, schedule payloads): what a handler receives
equals what was scheduled, on every database and broker, or scheduling
refuses it.  Accepted: ``None``, ``bool``, ``int``, ``str``, ``float``
(finite, magnitude below 10**16), ``list`` and ``dict`` with ``str`` keys,
nested at most :data:`MAX_DEPTH` deep.  Refused: tuples (they come back as
lists), non-``str`` dict keys (``{1: "a"}`` comes back as ``{"1": "a"}``),
sets, bytes, ``Decimal``, NaN and infinities, floats of 10**16 and more
(PostgreSQL's ``jsonb`` hands ``1e16`` back as the integer
10000000000000000), nesting deeper than MariaDB's JSON holds, and, as the
whole payload, a float without a fraction or an int beyond 64 bits (SQLite
turns a bare ``1.0`` into ``1``; inside a list or dict they are fine).
``-0.0`` comes back as ``0.0`` on PostgreSQL, which equals it.  Subclasses
(``StrEnum``, ``IntEnum``, ``OrderedDict``) arrive as their base type, equal
to what was sent.

**Instants** (due times, expiry times) are timezone-aware and lie in
``[EARLIEST, LATEST)``: from the Unix epoch (brokers count time from it)
up to the year 9000, which leaves about 1,000 years before the calendar's
end (9999-12-31, also MariaDB's) for what the relay and worker add to or
subtract from a due time (at most 100 years, :data:`MAX_SPAN`).
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from datetime import UTC, datetime, timedelta

from .errors import ValidationError

EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)
# The longest duration duebox adds to or subtracts from an instant on its
# own (a task's max_lateness, a retry's delay, the relay's "no ceiling").
MAX_SPAN = timedelta(days=36_500)
# MariaDB's JSON (its CHECK (json_valid(...))) holds 32 levels counting the
# innermost value: 31 nested lists or dicts.  The one rule for every database.
MAX_DEPTH = 31
_TOO_DEEP = f"must nest lists and dicts at most {MAX_DEPTH} levels deep"
# Floats at or above this magnitude are printed in exponent form, which
# PostgreSQL's jsonb reads as an exact integer and hands back as an int.
FLOAT_LIMIT = 1e16

_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
# Unicode categories that must not reach an operator's terminal or an audit
# line: controls (newline, ESC), format characters (bidi overrides, zero
# width), lone surrogates, line and paragraph separators.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


# --- text -------------------------------------------------------------------------


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as given, or None."""
    if value.isascii() and "\x00" not in value:  # the common case, without the regex
        return None
    m = _BAD_TEXT.search(value)
    if m is None:
        return None
    ch = m.group()
    where = f"at index {m.start()}"
    if ch == "\x00":
        return f"must not contain NUL (U+0000, {where}): PostgreSQL cannot store it"
    return (f"must not contain a lone surrogate (U+{ord(ch):04X}, {where}): it has no UTF-8 "
            "encoding")


def check_text(field: str, value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise ValidationError(field, problem, value)
    return value


def check_optional_str(field: str, value: object, limit: int) -> None:
    """None, or a non-empty string of at most ``limit`` characters that can be stored."""
    if value is None:
        return
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ValidationError(field, f"must be a non-empty string of at most {limit} characters",
                              value)
    check_text(field, value)


def check_printable(field: str, value: str) -> str:
    """Refuse what would disguise or forge a line on an operator's terminal:
    newlines, ESC and other controls, bidi overrides, line separators."""
    if value.isprintable():
        return value
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in _UNPRINTABLE:
            raise ValidationError(field, f"must not contain control or formatting characters "
                                  f"(U+{ord(ch):04X} at index {i})", value)
    return value


def shown(value: str) -> str:
    """``value`` safe to print on one line of a terminal: each control or
    formatting character (a newline, ESC, a bidi override) as its escape,
    e.g. ``\\n`` or ``\\x1b``; everything else unchanged.  For text that was
    stored before it could be checked, or was never the operator's (error
    messages, names)."""
    if value.isprintable():
        return value
    return "".join(ch.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(ch) in _UNPRINTABLE else ch for ch in value)


# --- JSON -------------------------------------------------------------------------


class _Unfaithful(Exception):
    """A value that would not come back equal; ``path`` grows while unwinding."""

    def __init__(self, rule: str, value: object) -> None:
        super().__init__(rule)
        self.rule = rule
        self.value = value
        self.path: list[str] = []


def check_json(value: object, field: str) -> None:
    """Refuse what would not come back equal through every database and broker
    (the module docstring has the rule), naming where inside ``value``."""
    try:
        _bare_number(value)
        _walk(value, 0)
    except _Unfaithful as bad:
        where = f"{field}{''.join(reversed(bad.path))}: " if bad.path else ""
        raise ValidationError(field, f"{where}{bad.rule}", bad.value) from None


def _bare_number(value: object) -> None:
    """SQLite stores a JSON column's text that reads as a number as that
    number (NUMERIC affinity): a bare ``1.0`` comes back as ``1``, a bare int
    beyond 64 bits as a float.  Inside a list or dict the text is kept."""
    if isinstance(value, float) and value.is_integer():
        raise _Unfaithful("a bare float without a fraction comes back as an int on SQLite; "
                          "wrap it in a list or dict", value)
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64 <= value < -_INT64:
        raise _Unfaithful("a bare int beyond 64 bits comes back as a float on SQLite; "
                          "wrap it in a list or dict", value)


_INT64 = -(2**63)


# What each JSON type is to the walk, looked up by exact type (the walk runs
# for every job scheduled); a subclass (StrEnum, OrderedDict) by isinstance.
_STR, _PLAIN, _FLOAT, _DICT, _LIST = range(5)
_KINDS: dict[type, int] = {str: _STR, int: _PLAIN, bool: _PLAIN, type(None): _PLAIN,
                           float: _FLOAT, dict: _DICT, list: _LIST}
_BASES = ((str, _STR), (int, _PLAIN), (float, _FLOAT), (dict, _DICT), (list, _LIST))


def _kind(value: object) -> int:
    kind = _KINDS.get(type(value))
    if kind is not None:
        return kind
    for base, kind in _BASES:
        if isinstance(value, base):
            return kind
    name = type(value).__name__
    hint = " (it would come back as a list)" if isinstance(value, tuple) else ""
    raise _Unfaithful(f"must be JSON: None, bool, int, float, str, list, or dict with str keys; "
                      f"not {name}{hint}", value)


def _walk(value: object, depth: int) -> None:
    kind = _kind(value)
    if kind == _PLAIN:
        return
    if kind == _STR:
        problem = text_problem(value)  # type: ignore[arg-type]
        if problem is not None:
            raise _Unfaithful(problem, value)
        return
    if kind == _FLOAT:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise _Unfaithful("must be a finite number (JSON has no NaN or infinity)", value)
        if abs(value) >= FLOAT_LIMIT:  # type: ignore[arg-type]
            raise _Unfaithful("a float must be below 1e16 in magnitude (PostgreSQL hands larger "
                              "ones back as integers); send an int or a string", value)
        return
    if depth >= MAX_DEPTH:
        raise _Unfaithful(_TOO_DEEP, ...)
    if kind == _DICT:
        for key, item in value.items():  # type: ignore[attr-defined]
            if not isinstance(key, str):
                raise _Unfaithful(f"dict keys must be strings (JSON turns the key {key!r} into "
                                  f"{json.dumps(str(key))})", key)
            try:
                problem = text_problem(key)
                if problem is not None:
                    raise _Unfaithful(f"key {problem}", key)
                if _KINDS.get(type(item)) != _PLAIN:
                    _walk(item, depth + 1)
            except _Unfaithful as bad:
                bad.path.append(f"[{key!r}]")
                raise
        return
    for i, item in enumerate(value):  # type: ignore[arg-type]
        try:
            if _KINDS.get(type(item)) != _PLAIN:
                _walk(item, depth + 1)
        except _Unfaithful as bad:
            bad.path.append(f"[{i}]")
            raise


# One encoder: json.dumps() with options builds a new one on every call.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def encode_json(value: object, field: str = "payload") -> str:
    """The JSON text of ``value``, or a refusal of what has none.  Whether it
    comes back equal is :func:`check_json`'s question, asked once the size is
    known to fit (a walk over a huge value costs more than encoding it)."""
    try:
        return _ENCODER.encode(value)
    except RecursionError:
        raise ValidationError(field, _TOO_DEEP) from None
    except (TypeError, ValueError) as exc:
        raise ValidationError(field, f"must be JSON-serialisable ({exc})") from None


# --- instants ---------------------------------------------------------------------


def aware(field: str, value: object) -> datetime:
    """``value`` as a UTC instant within ``[EARLIEST, LATEST)``."""
    if not isinstance(value, datetime):
        raise ValidationError(field, "must be a timezone-aware datetime", value)
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValidationError(
            field, "must be timezone-aware (naive datetimes are ambiguous; use tzinfo=UTC)",
            value,
        )
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        utc = None
    if utc is None or not EARLIEST <= utc < LATEST:
        raise ValidationError(field, f"must be from {EARLIEST:%Y-%m-%d} up to (not including) "
                              f"{LATEST:%Y-%m-%d} UTC", value)
    return utc


def seconds_of(field: str, value: object) -> float:
    """A duration given as a timedelta or a number of seconds: finite, >= 0."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            seconds = math.inf
    else:
        raise ValidationError(field, "must be a timedelta or a number of seconds", value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValidationError(field, "must be a finite number of seconds >= 0", value)
    return seconds


def check_span(field: str, seconds: float) -> float:
    """A duration duebox will add to instants: at most :data:`MAX_SPAN`."""
    if seconds > MAX_SPAN.total_seconds():
        raise ValidationError(field, f"must be at most {MAX_SPAN.days} days "
                              f"({MAX_SPAN.total_seconds():.0f} s)", seconds)
    return seconds


# The audit table's column widths (tables.audit); longer values are refused
# rather than cut, so what is recorded is what the operator said.
_OPERATOR_MAX = 200
_REASON_MAX = 2000


def check_operator(operator: object, reason: object) -> tuple[str, str]:
    """Who and why, both required for an audited action; refused before any
    write.  Both are shown to operators one line per action (``duebox jobs
    show``, the dashboard), so neither may carry a newline, ESC or another
    control or formatting character that could forge or hide a line."""
    if not isinstance(operator, str) or not operator.strip():
        raise ValidationError("operator", "an operator identity is required for this action",
                              operator)
    if len(operator.strip()) > _OPERATOR_MAX:
        raise ValidationError("operator", f"must be at most {_OPERATOR_MAX} characters",
                              operator)
    if not isinstance(reason, str) or not reason.strip():
        raise ValidationError("reason", "a reason is required for this action", reason)
    if len(reason.strip()) > _REASON_MAX:
        raise ValidationError("reason", f"must be at most {_REASON_MAX} characters", reason)
    return check_printable("operator", operator.strip()), check_printable("reason", reason.strip())
