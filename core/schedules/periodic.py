"""Schedules declared in code, next to the task they run::

    @app.task("send-report", schedule="0 9 * * *", timezone="Europe/Berlin")
    def send_report(payload, ctx): ...

    @app.task("sync-prices", schedule=[
        Periodic("*/15 * * * *", name="sync-prices-eu", payload={"region": "eu"}),
        Periodic("*/15 * * * *", name="sync-prices-us", payload={"region": "us"},
                 timezone="America/New_York"),
    ])
    def sync_prices(payload, ctx): ...

Why a keyword of ``@app.task`` rather than a separate ``@app.periodic``: the
rule sits on the handler it runs, a reader sees both in one place, and the
task's queue and max_attempts need no repeating; a task with several
schedules (different payloads or zones) lists :class:`Periodic` values.

A declaration is a wish, not a row: relays make the schedule table match
the declarations when they start (:mod:`duebox.schedules.sync`).  The rule,
zone and policies are checked here, at import time; the payload and queue,
which depend on the configured broker, when the relay syncs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import ConfigurationError, ValidationError
from .api import DEFAULT_MISFIRE, DEFAULT_OVERLAP, MISFIRE_POLICIES, OVERLAP_POLICIES
from .cron import DEFAULT_FOLD, DEFAULT_GAP, Rule, check_policy


@dataclass(frozen=True)
class Periodic:
    """One schedule declared in code; the arguments of ``app.schedules.add``.
    ``name`` defaults to the task's name (one schedule per task); give each
    a name when a task has several."""

    cron: str
    timezone: str = "UTC"
    name: str | None = None
    payload: Any = None
    queue: str | None = None
    jitter: int | timedelta = 0
    misfire: str = DEFAULT_MISFIRE
    overlap: str = DEFAULT_OVERLAP
    gap: str = DEFAULT_GAP
    fold: str = DEFAULT_FOLD
    priority: int = 0
    expire_after: int | timedelta | None = None
    # Filled in by @app.task: the task this schedule runs.
    task: str = field(default="", compare=False)

    def check(self) -> None:
        """What can be checked without a database or broker: the rule in its
        zone with its DST policies, and the misfire and overlap policies."""
        Rule(self.cron, self.timezone, gap=self.gap, fold=self.fold)
        check_policy("misfire", self.misfire, MISFIRE_POLICIES)
        check_policy("overlap", self.overlap, OVERLAP_POLICIES)

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``app.schedules.put``."""
        return {"timezone": self.timezone, "payload": self.payload, "queue": self.queue,
                "jitter": self.jitter, "misfire": self.misfire, "overlap": self.overlap,
                "gap": self.gap, "fold": self.fold, "priority": self.priority,
                "expire_after": self.expire_after}


def declarations(task: str, schedule: str | Periodic | Sequence[Periodic] | None,
                 timezone: str | None) -> list[Periodic]:
    """The schedules ``@app.task(task, schedule=..., timezone=...)`` declares,
    checked and named (a bad rule fails at import, naming the task)."""
    if schedule is None:
        if timezone is not None:
            raise ConfigurationError(f"task {task!r}: timezone= applies to schedule=, "
                                     "which is not given")
        return []
    if isinstance(schedule, str):
        items = [Periodic(schedule, timezone or "UTC")]
    elif timezone is not None:
        raise ConfigurationError(f"task {task!r}: with Periodic(...) values give each its "
                                 "own timezone=, not the task's")
    elif isinstance(schedule, Periodic):
        items = [schedule]
    elif isinstance(schedule, Sequence) and all(isinstance(p, Periodic) for p in schedule):
        items = [p for p in schedule if isinstance(p, Periodic)]
    else:
        raise ConfigurationError(f"task {task!r}: schedule= must be a cron string, a "
                                 f"Periodic or a list of them (got {schedule!r})")
    out = []
    for p in items:
        named = Periodic(**{**p.__dict__, "name": p.name or task, "task": task})
        try:
            named.check()
        except ValidationError as exc:
            raise ConfigurationError(f"task {task!r}, schedule {named.name!r}: {exc}") from None
        out.append(named)
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"task {task!r}: its schedules need distinct names "
                                 f"(got {names})")
    return out


__all__ = ["Periodic", "declarations"]
