"""Cron rules evaluated in an IANA time zone, with daylight saving time made explicit.

A rule is a cron expression over *wall-clock* time in one zone.  croniter
enumerates naive local wall times (it treats a naive datetime as a plain
calendar value, so the machine's own zone never leaks in); every wall time is
then mapped to UTC instants with :mod:`zoneinfo` and classified by
round-tripping it through both ``fold`` values:

* **regular** — one instant;
* **fold** (fall back: the wall time happens twice) — resolved by the
  rule's ``fold`` policy: ``first`` (the earlier instant, the default),
  ``last`` (the later one) or ``both``;
* **gap** (spring forward: the wall time never happens) — resolved by the
  ``gap`` policy: ``shift`` (the first instant after the gap, the default) or
  ``skip``.  Several wall times inside one gap all shift to the same instant
  and fire once.

The resulting stream of instants is strictly increasing (``both`` can
interleave the two passes through a repeated hour, so instants are put back
in order before they are yielded).  See docs/schedules.md for a table of what
each policy does on real transitions.
"""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from ..errors import ValidationError

GAP_POLICIES = ("shift", "skip")
FOLD_POLICIES = ("first", "last", "both")
DEFAULT_GAP = "shift"
DEFAULT_FOLD = "first"

ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

_SECOND = timedelta(seconds=1)
# Transitions are looked for this far either side of an instant: a fold
# ahead moves wall time back by its size, so its wall times come earlier.
_WINDOW_HOURS = 30
# Safety net for pathological rules (e.g. a rule that only names wall times
# that never exist): how many wall times one search may look at.
_MAX_STEPS = 2_000_000


def parse_cron(expr: object) -> str:
    """Validate a 5-field (minute) or 6-field (second first) cron expression,
    or an ``@daily``-style alias; return it normalised."""
    if not isinstance(expr, str) or not expr.strip():
        raise ValidationError("cron", "must be a non-empty cron expression", expr)
    text = " ".join(expr.split())
    text = ALIASES.get(text.lower(), text)
    fields = text.split(" ")
    if len(fields) not in (5, 6):
        raise ValidationError(
            "cron",
            "must have 5 fields (minute hour day-of-month month day-of-week) or 6 "
            "(second first), or be one of " + ", ".join(sorted(ALIASES)),
            expr,
        )
    if any(f.upper().startswith("H") or "H(" in f.upper() for f in fields):
        raise ValidationError("cron", "hashed fields (H) are not supported", expr)
    if not _croniter().is_valid(text, second_at_beginning=True):
        problem = _field_problem(fields)
        raise ValidationError("cron", problem or "is not a valid cron expression", expr)
    return text


# Each field's name, range and the names it accepts, minute first; a 6-field
# rule puts the second in front.
_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day-of-month", 1, 31, ()),
    ("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                      "nov", "dec")),
    ("day-of-week", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)
_SECOND_FIELD = ("second", 0, 59, ())


def _field_problem(fields: list[str]) -> str | None:
    """Which field of a rule croniter refused, and why: "minute field '61' is
    out of range 0-59".  None when no single value is to blame (then the
    caller says the expression as a whole is not valid)."""
    specs = ((_SECOND_FIELD,) if len(fields) == 6 else ()) + _FIELDS
    for (name, lo, hi, names), text in zip(specs, fields, strict=True):
        for part in text.split(","):
            problem = _part_problem(part, lo, hi, names)
            if problem is not None:
                return f"{name} field {problem}"
    return None


def _part_problem(part: str, lo: int, hi: int, names: tuple[str, ...]) -> str | None:
    span, _, step = part.partition("/")
    if step and (not step.isdigit() or int(step) < 1):
        return f"step '{step}' must be a whole number >= 1"
    if not span:
        return f"'{part}' is empty"
    if span in ("*", "?") or "L" in span.upper() or "#" in span or "W" in span.upper():
        return None  # special forms: croniter's own judgement stands
    for value in span.split("-"):
        if value.isdigit():
            if not lo <= int(value) <= hi:
                return f"'{value}' is out of range {lo}-{hi}"
        elif value.lower() not in names:
            return (f"'{value}' is not a number from {lo} to {hi}"
                    + (f" or a name ({', '.join(names[:3])} ...)" if names else ""))
    return None


# Present in some systems' zone directories but not IANA zones: they would
# mean whatever the machine is set to.
_MACHINE_ZONES = frozenset({"localtime", "posixrules"})


@functools.lru_cache(maxsize=1)
def _known_zones() -> frozenset[str]:
    return frozenset(available_timezones()) - _MACHINE_ZONES


@functools.lru_cache(maxsize=512)
def load_zone(name: object) -> ZoneInfo:
    """An IANA zone by key (``Europe/Berlin``); tzdata supplies it where the OS has none."""
    if not isinstance(name, str) or not name or name not in _known_zones():
        raise ValidationError(
            "timezone", "must be an IANA time zone name such as 'Europe/Berlin' or 'UTC'", name
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:  # pragma: no cover - listed but broken
        raise ValidationError("timezone", f"cannot be loaded ({exc})", name) from None


def check_policy(field: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValidationError(field, "must be one of " + ", ".join(allowed), value)
    return value


def wall_of(instant: datetime, zone: tzinfo) -> datetime:
    """The naive local wall time of an instant."""
    return instant.astimezone(zone).replace(tzinfo=None)


@dataclass(frozen=True, slots=True)
class Resolution:
    """What one wall time means in a zone: ``kind`` is ``regular``, ``fold``
    or ``gap``; ``first``/``second`` are the two instants of a fold (equal
    otherwise); for a gap both are the first instant after it."""

    kind: str
    first: datetime
    second: datetime


def resolve(wall: datetime, zone: tzinfo) -> Resolution:
    """Map a naive wall time to instants, detecting gaps and folds by round trip."""
    a = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    b = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if a == b:
        return Resolution("regular", a, a)
    lo, hi = min(a, b), max(a, b)
    if wall_of(lo, zone) == wall and wall_of(hi, zone) == wall:
        return Resolution("fold", lo, hi)
    after = _gap_end(lo, hi, wall, zone)
    return Resolution("gap", after, after)


def _gap_end(lo: datetime, hi: datetime, wall: datetime, zone: tzinfo) -> datetime:
    """The first instant whose wall time is past ``wall`` (a non-existent
    time): the transition instant, found by bisection on whole seconds."""
    lo_s = math.floor(lo.timestamp())
    hi_s = math.ceil(hi.timestamp())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if datetime.fromtimestamp(mid, zone).replace(tzinfo=None) > wall:
            hi_s = mid
        else:
            lo_s = mid
    return datetime.fromtimestamp(hi_s, UTC)


def _offset_at(zone: tzinfo, ts: int) -> timedelta | None:
    try:
        return datetime.fromtimestamp(ts, zone).utcoffset()
    except (OverflowError, OSError, ValueError):
        return None


@functools.lru_cache(maxsize=4096)
def _transitions_near(zone: tzinfo, hour: int) -> tuple[tuple[datetime, timedelta, timedelta], ...]:
    """``(instant, offset before, offset after)`` of every UTC-offset change
    within ``_WINDOW_HOURS`` of the hour ``hour`` (hourly probes, then
    bisection to the second)."""
    found = []
    prev_ts = (hour - _WINDOW_HOURS - 1) * 3600
    prev_off = _offset_at(zone, prev_ts)
    for h in range(hour - _WINDOW_HOURS, hour + _WINDOW_HOURS + 2):
        ts = h * 3600
        off = _offset_at(zone, ts)
        if off is not None and prev_off is not None and off != prev_off:
            lo, hi = prev_ts, ts
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _offset_at(zone, mid) == prev_off:
                    lo = mid
                else:
                    hi = mid
            found.append((datetime.fromtimestamp(hi, UTC), prev_off, off))
        prev_ts, prev_off = ts, off
    return tuple(found)


def _folds_near(zone: tzinfo, at: datetime) -> list[tuple[datetime, timedelta, timedelta]]:
    """Transitions near ``at`` that turn the clock back."""
    hour = math.floor(at.timestamp() / 3600)
    return [t for t in _transitions_near(zone, hour) if t[2] < t[1]]


def _naive(instant: datetime) -> datetime:
    return instant.astimezone(UTC).replace(tzinfo=None)


@functools.lru_cache(maxsize=1024)
def _prototype(cron: str) -> Any:
    """A parsed croniter to copy: parsing costs more than a dozen steps."""
    return _croniter()(cron, datetime(2000, 1, 1), second_at_beginning=True)


def _croniter() -> Any:
    """croniter's class, imported where a cron is first read: 40 ms of every
    worker's and relay's start otherwise."""
    from croniter import croniter

    return croniter


@dataclass(frozen=True, slots=True)
class Fire:
    """One instant a rule fires: ``at`` (UTC), the nominal wall time that
    produced it, and how it was resolved: ``regular``, ``gap-shift``,
    ``fold-first`` or ``fold-second``."""

    at: datetime
    wall: datetime
    kind: str

    def describe(self, zone: tzinfo) -> str:
        """A human note for DST-resolved fires, '' for regular ones."""
        local = self.at.astimezone(zone)
        if self.kind == "gap-shift":
            return (f"{self.wall:%H:%M:%S} does not exist that day (clocks go forward): "
                    f"shifted to {local:%H:%M:%S}")
        if self.kind == "fold-first":
            return f"{self.wall:%H:%M:%S} happens twice that day (clocks go back): first one"
        if self.kind == "fold-second":
            return f"{self.wall:%H:%M:%S} happens twice that day (clocks go back): second one"
        return ""


@dataclass(frozen=True)
class Rule:
    """A cron expression in a zone with its DST policies; all methods are pure."""

    cron: str
    timezone: str = "UTC"
    gap: str = DEFAULT_GAP
    fold: str = DEFAULT_FOLD

    def __post_init__(self) -> None:
        object.__setattr__(self, "cron", parse_cron(self.cron))
        load_zone(self.timezone)
        check_policy("gap", self.gap, GAP_POLICIES)
        check_policy("fold", self.fold, FOLD_POLICIES)

    @property
    def zone(self) -> ZoneInfo:
        return load_zone(self.timezone)

    # --- wall times ---------------------------------------------------------

    def _walls(self, start: datetime, *, backwards: bool = False) -> Iterator[datetime]:
        """Matching naive wall times strictly after (or before) ``start``."""
        it: Any = copy.copy(_prototype(self.cron))
        it.set_current(start, force=True)
        step = it.get_prev if backwards else it.get_next
        for _ in range(_MAX_STEPS):
            try:
                wall: datetime = step(datetime)
            except (ValueError, OverflowError):  # CroniterBadDateError is a ValueError
                return
            yield wall

    def fires_at_wall(self, wall: datetime) -> list[Fire]:
        """The fires one matching wall time produces under this rule's policies."""
        r = resolve(wall, self.zone)
        if r.kind == "regular":
            return [Fire(r.first, wall, "regular")]
        if r.kind == "gap":
            return [Fire(r.first, wall, "gap-shift")] if self.gap == "shift" else []
        fires = []
        if self.fold in ("first", "both"):
            fires.append(Fire(r.first, wall, "fold-first"))
        if self.fold in ("last", "both"):
            fires.append(Fire(r.second, wall, "fold-second"))
        return fires

    # --- instants -----------------------------------------------------------

    def fires_from(self, start: datetime) -> Iterator[Fire]:
        """Every fire at or after ``start``, strictly increasing in time.

        Wall times are walked in order from the earliest one that can map to
        an instant >= ``start`` (a fold puts later instants at earlier wall
        times).  The earliest instant of each wall time never decreases along
        the walk, so anything buffered at or below it is final and is yielded.
        """
        start = start.astimezone(UTC)
        zone = self.zone
        # The earliest wall time that can map to an instant >= start: start's
        # own (or, right after a gap, the gap's first wall time), or the wall
        # time a fold coming soon turns the clock back to (only its second
        # pass can fire later, so not with fold="first").
        floor = min(wall_of(start, zone), wall_of(start - _SECOND, zone) + _SECOND)
        for when, _, after in _folds_near(zone, start) if self.fold != "first" else ():
            if when > start:
                floor = min(floor, _naive(when) + after)
        wall0 = floor.replace(microsecond=0) - _SECOND
        heap: list[tuple[datetime, int, Fire]] = []
        seq = itertools.count()
        last: datetime | None = None
        for wall in self._walls(wall0):
            fires = self.fires_at_wall(wall)
            if not fires:
                continue
            for f in fires:
                if f.at >= start:
                    heapq.heappush(heap, (f.at, next(seq), f))
            lowest = fires[0].at
            while heap and heap[0][0] <= lowest:
                fire = heapq.heappop(heap)[2]
                if fire.at != last:
                    last = fire.at
                    yield fire
        while heap:
            fire = heapq.heappop(heap)[2]
            if fire.at != last:
                last = fire.at
                yield fire

    def next_after(self, instant: datetime) -> Fire | None:
        """The first fire strictly after ``instant``."""
        return next((f for f in self.fires_from(instant) if f.at > instant), None)

    def upcoming(self, after: datetime, n: int) -> list[Fire]:
        """The next ``n`` fires strictly after ``after``."""
        out: list[Fire] = []
        if n <= 0:
            return out
        for f in self.fires_from(after):
            if f.at > after:
                out.append(f)
                if len(out) >= n:
                    break
        return out

    def last_before(self, instant: datetime, not_before: datetime | None = None) -> Fire | None:
        """The latest fire strictly before ``instant`` (and at or after
        ``not_before``), found by walking wall times backwards."""
        instant = instant.astimezone(UTC)
        zone = self.zone
        # The latest wall time that can map to an instant < instant: its own,
        # or the end of the first pass through a fold that just happened (only
        # that pass fired earlier, so not with fold="last").
        ceiling = wall_of(instant, zone)
        for when, before, _ in _folds_near(zone, instant) if self.fold != "last" else ():
            if when <= instant:
                ceiling = max(ceiling, _naive(when) + before)
        wall0 = ceiling.replace(microsecond=0) + 2 * _SECOND
        best: Fire | None = None
        for wall in self._walls(wall0, backwards=True):
            fires = self.fires_at_wall(wall)
            if not fires:
                continue
            for f in fires:
                if f.at < instant and (not_before is None or f.at >= not_before) and (
                    best is None or f.at > best.at
                ):
                    best = f
            top = fires[-1].at
            # The latest instant of each wall time never increases walking back.
            if best is not None and top < best.at:
                break
            if not_before is not None and top < not_before:
                break
        return best


@functools.lru_cache(maxsize=4096)
def cached_rule(cron: str, timezone: str, gap: str, fold: str) -> Rule:
    """A validated :class:`Rule`, parsed once per process (rules are immutable)."""
    return Rule(cron, timezone, gap=gap, fold=fold)
