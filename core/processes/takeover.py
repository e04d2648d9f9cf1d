"""Taking over a dead process's jobs: the peer's side of core/processes/liveness.py.

The relay's recovery pass (every ``recover_interval``, 1 s) asks
:meth:`Takeover.find` which registered processes are confirmed dead: one
read of the registry and one look at all their locks, whatever the number
of jobs.  For each it returns the dead process's leased jobs at once
(:meth:`Takeover.recover`: ``recovery.recover_owned``, fenced on the owner),
the caller lets the broker hand on the messages the process had received
(``Broker.take_over``), and :meth:`Takeover.forget` drops its registry row.
A dead process's row stays until all three are done, so a failure in between
is simply done again on the next pass: each step is idempotent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, delete, select

from ..db import db_errors
from ..leases import recovery
from ..tables import lease
from .heartbeat import watched
from .liveness import DeathWatch, forget, supported

log = logging.getLogger("duebox.takeover")


@dataclass(frozen=True)
class DeadProcess:
    """A registered process whose liveness lock is gone."""

    name: str  # the process name, which its lease owners start with
    row: str  # its registry row (``worker:<name>``)
    role: str
    info: dict[str, Any] = field(default_factory=dict)  # its registry row's


class Takeover:
    def __init__(self, engine: Engine, clock: Any, limit: int, own_name: str) -> None:
        self.engine = engine
        self.clock = clock
        self.limit = limit
        self.own_name = own_name
        self.watch = DeathWatch()
        self.enabled = supported(engine)

    def find(self) -> list[DeadProcess]:
        """The registered processes confirmed dead now (none where the
        database cannot tell: in-memory SQLite)."""
        if not self.enabled:
            return []
        with db_errors("liveness"), self.engine.connect() as conn:
            rows = watched(conn)
            rows.pop(self.own_name, None)
            dead = self.watch.dead(conn, list(rows))
            if not dead:
                return []
            infos = dict(conn.execute(select(lease.c.name, lease.c.info)
                                      .where(lease.c.name.in_([rows[n] for n in dead]))).all())
        out = []
        for name in dead:
            info = infos.get(rows[name])
            out.append(DeadProcess(name=name, row=rows[name], role=rows[name].split(":", 1)[0],
                                   info=dict(info) if isinstance(info, dict) else {}))
        return out

    def recover(self, dead: DeadProcess) -> recovery.Recovered:
        """Every job ``dead`` still holds a lease on, back to SCHEDULED now."""
        counts = [0, 0, 0]
        while True:
            with db_errors("recover a dead process's jobs"), self.engine.begin() as conn:
                got = recovery.recover_owned(conn, process=dead.name, now=self.clock.now(),
                                             limit=self.limit)
            counts = [counts[0] + got.dispatching, counts[1] + got.running, counts[2] + got.dead]
            if got.dispatching < self.limit and got.running + got.dead < self.limit:
                return recovery.Recovered(*counts)

    def forget(self, dead: DeadProcess) -> None:
        """Drop the dead process's registry row (and lock file): its jobs are
        back, its messages handed on."""
        with db_errors("forget a dead process"), self.engine.begin() as conn:
            conn.execute(delete(lease).where(lease.c.name == dead.row))
        forget(self.engine, dead.name)


__all__ = ["DeadProcess", "Takeover"]
