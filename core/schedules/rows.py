"""A schedule as stored: its record, the look-up by id or name, and the audit
row of an operator's change.  Shared by the API (:mod:`duebox.schedules.api`) and
the upsert (:mod:`duebox.schedules.put`)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, select

from ..errors import ValidationError
from ..ids import uuid7
from ..producer import Steps
from ..tables import audit, schedule
from ..validation import check_operator, check_text
from .cron import Rule, cached_rule

# Where a schedule came from (the ``origin`` column): made by hand with
# app.schedules or the CLI, or declared next to its task and kept in step
# with the code by the relay's sync, which touches no other.
ORIGIN_API = "api"
ORIGIN_CODE = "code"


class ScheduleNotFoundError(ValidationError):
    """No schedule has this id or name."""

    def __init__(self, ref: object) -> None:
        super().__init__("schedule", "must be the id or name of an existing schedule", ref)


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule as stored.  ``origin`` is ``"api"`` (made by hand) or
    ``"code"`` (declared with ``@app.task(schedule=...)``); ``retired_at``
    is when the relay's sync paused a ``"code"`` schedule that left the
    code."""

    id: uuid.UUID
    name: str
    task: str
    queue: str
    cron: str
    timezone: str
    payload: Any
    next_fire_at: datetime | None
    last_fire_at: datetime | None
    misfire: str
    overlap: str
    gap: str
    fold: str
    jitter: int
    priority: int
    max_attempts: int
    expire_after: int | None
    version: int
    paused: bool
    created_at: datetime
    updated_at: datetime
    origin: str = ORIGIN_API
    retired_at: datetime | None = None

    @property
    def rule(self) -> Rule:
        return cached_rule(self.cron, self.timezone, self.gap, self.fold)

    @classmethod
    def from_row(cls, row: Row[Any]) -> ScheduleInfo:
        return cls.from_mapping(row._mapping)

    @classmethod
    def from_mapping(cls, m: Mapping[Any, Any]) -> ScheduleInfo:
        """From a row's mapping, or the values of a row about to be inserted."""
        return cls(
            id=m["id"], name=m["name"], task=m["task"], queue=m["queue"], cron=m["cron"],
            timezone=m["timezone"], payload=m["payload"], next_fire_at=m["next_fire_at"],
            last_fire_at=m["last_fire_at"], misfire=m["misfire_policy"],
            overlap=m["overlap_policy"], gap=m["gap_policy"], fold=m["fold_policy"],
            jitter=m["jitter_seconds"], priority=m["priority"], max_attempts=m["max_attempts"],
            expire_after=m["expire_after_seconds"], version=m["version"],
            paused=bool(m["paused"]), created_at=m["created_at"], updated_at=m["updated_at"],
            origin=m.get("origin") or ORIGIN_API, retired_at=m.get("retired_at"),
        )


def ref_condition(ref: object) -> Any:
    """The WHERE clause finding a schedule by id (UUID or its text) or name."""
    if isinstance(ref, uuid.UUID):
        return schedule.c.id == ref
    if isinstance(ref, str) and ref:
        try:
            return schedule.c.id == uuid.UUID(ref)
        except ValueError:
            return schedule.c.name == check_text("schedule", ref)
    raise ValidationError("schedule", "must be a schedule id (UUID) or name", ref)


def get_steps(ref: object, *, lock: bool = False) -> Steps[ScheduleInfo]:
    """The schedule ``ref`` names; :class:`ScheduleNotFoundError` if none.
    ``lock``: ``FOR UPDATE``, for a change that depends on what it read."""
    found = yield from find_steps(ref, lock=lock)
    if found is None:
        raise ScheduleNotFoundError(ref)
    return found


def find_steps(ref: object, *, lock: bool = False) -> Steps[ScheduleInfo | None]:
    stmt = select(schedule).where(ref_condition(ref))
    result = yield stmt.with_for_update() if lock else stmt
    row = result.first()
    return None if row is None else ScheduleInfo.from_row(row)


def audit_steps(now: datetime, who: tuple[str, str] | None, action: str, info: ScheduleInfo,
                **details: Any) -> Steps[None]:
    """The audit row of an operator's action on a schedule (none without an
    operator: the application's own calls, like cancel's)."""
    if who is not None:
        yield audit.insert().values(
            id=uuid7(), at=now, operator=who[0], action=f"schedule_{action}", job_id=None,
            reason=who[1],
            details={"schedule": info.name, "schedule_id": str(info.id), **details})


def check_who(operator: object, reason: object) -> tuple[str, str] | None:
    """Operator and reason checked before any SQL; None when neither is given."""
    if operator is None and reason is None:
        return None
    return check_operator(operator, reason)


__all__ = [
    "ORIGIN_API",
    "ORIGIN_CODE",
    "ScheduleInfo",
    "ScheduleNotFoundError",
    "audit_steps",
    "check_who",
    "find_steps",
    "get_steps",
    "ref_condition",
]
