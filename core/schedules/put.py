"""The schedule upsert behind ``app.schedules.put`` and ``duebox schedules add
--update``: make the stored schedule look like the arguments.

One transaction (the caller's) and one row lock:

1. read the schedule by name ``FOR UPDATE``;
2. none: insert it (``ON CONFLICT DO NOTHING``).  Inserted: done.  Someone
   else's insert won the race: read it again, locked, and go on;
3. compare every setting with what is stored.  Equal: no write at all (no
   version bump, no audit row), so a deploy that re-declares the same
   schedules changes nothing.  Different: one fenced update that bumps the
   version, moves the fire-time cursor to the next fire after now when the
   rule itself changed (cron, zone, DST policies), and, with an operator,
   writes an audit row ``schedule_update`` naming each changed setting.

What is not compared: ``paused`` (pausing and resuming are operations, not
settings: a deploy never resumes what an operator paused; it applies when
put creates the schedule) and the name (the key).  Occurrences already
generated keep the settings they were made with.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import update

from ..db import insert_if_absent
from ..producer import Steps
from ..tables import schedule
from .rows import (
    ORIGIN_API,
    ORIGIN_CODE,
    ScheduleInfo,
    ScheduleNotFoundError,
    audit_steps,
    find_steps,
)

# The settings put compares: (column, ScheduleInfo attribute).
_SETTINGS = (
    ("task", "task"), ("queue", "queue"), ("cron", "cron"), ("timezone", "timezone"),
    ("payload", "payload"), ("misfire_policy", "misfire"), ("overlap_policy", "overlap"),
    ("gap_policy", "gap"), ("fold_policy", "fold"), ("jitter_seconds", "jitter"),
    ("priority", "priority"), ("max_attempts", "max_attempts"),
    ("expire_after_seconds", "expire_after"),
)
# A change to one of these moves the fire-time cursor.
_RULE = frozenset({"cron", "timezone", "gap_policy", "fold_policy"})

CREATED = "created"
UPDATED = "updated"
UNCHANGED = "unchanged"
# The relay's sync met a schedule of that name made by hand: left alone.
HAND_MADE = "hand-made"


@dataclass(frozen=True)
class PutResult:
    """What :meth:`Schedules.put` did: ``outcome`` is ``"created"``,
    ``"updated"`` or ``"unchanged"``; ``changed`` names the settings that
    differed (columns, e.g. ``"cron"``, ``"payload"``); ``version`` is the
    schedule's version afterwards."""

    id: uuid.UUID
    outcome: str
    changed: tuple[str, ...]
    version: int

    @property
    def wrote(self) -> bool:
        return self.outcome in (CREATED, UPDATED)


def _same(a: Any, b: Any) -> bool:
    # Payloads come back from JSON: compare them as JSON (key order aside).
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True,
                                                                   default=str)


def differences(info: ScheduleInfo, values: dict[str, Any]) -> tuple[str, ...]:
    """The settings in ``values`` (a validated row) that differ from ``info``."""
    return tuple(col for col, attr in _SETTINGS if not _same(getattr(info, attr), values[col]))


def put_steps(values: dict[str, Any], dialect: str, now: datetime,
              who: tuple[str, str] | None, *, origin: str = ORIGIN_API) -> Steps[PutResult]:
    """Create or update the schedule ``values["name"]`` (see the module
    docstring).  ``origin="code"`` is the relay's sync: it creates with that
    origin, leaves a hand-made schedule of the same name alone
    (``"hand-made"``), and resumes a schedule it had paused when it left the
    code."""
    name = values["name"]
    current = yield from find_steps(name, lock=True)
    if current is None:
        row = {**values, "origin": origin, "retired_at": None}
        result = yield insert_if_absent(schedule, row, dialect, ["name"])
        if result.rowcount == 1:
            created = ScheduleInfo.from_mapping(row)
            yield from audit_steps(now, who, "add", created, task=created.task,
                                   cron=created.cron, timezone=created.timezone)
            return PutResult(created.id, CREATED, (), created.version)
        current = yield from find_steps(name, lock=True)
        if current is None:  # inserted and deleted meanwhile by others
            raise ScheduleNotFoundError(name)
    if origin == ORIGIN_CODE and current.origin != ORIGIN_CODE:
        return PutResult(current.id, HAND_MADE, (), current.version)
    changed = differences(current, values)
    revive = origin == ORIGIN_CODE and current.retired_at is not None
    if not changed and not revive:
        return PutResult(current.id, UNCHANGED, (), current.version)
    new = {col: values[col] for col in changed}
    if _RULE.intersection(changed) or revive:
        nxt = ScheduleInfo.from_mapping({**values, "id": current.id}).rule.next_after(now)
        new["next_fire_at"] = nxt.at if nxt else None
    if revive:
        new.update(paused=False, retired_at=None)
        changed += ("resumed",)
    result = yield (update(schedule)
                    .where(schedule.c.id == current.id, schedule.c.version == current.version)
                    .values(**new, version=current.version + 1, updated_at=now))
    if result.rowcount != 1:  # the row is locked: only a deletion gets here
        raise ScheduleNotFoundError(name)
    yield from audit_steps(
        now, who, "update", current, changed={
            col: [_shown(getattr(current, attr)), _shown(values[col])]
            for col, attr in _SETTINGS if col in changed})
    return PutResult(current.id, UPDATED, changed, current.version + 1)


def _shown(value: Any) -> Any:
    return value if value is None or isinstance(value, str | int | float | bool) \
        else json.loads(json.dumps(value, default=str))


__all__ = ["CREATED", "HAND_MADE", "UNCHANGED", "UPDATED", "PutResult", "differences",
           "put_steps"]
