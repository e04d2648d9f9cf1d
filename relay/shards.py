"""Sharded relays with fenced ownership (optional; off by default).

Jobs hash into :data:`~duebox.tables.SHARD_SLOTS` slots (``duebox_job.shard``,
set at insert).  With ``ShardConfig(count=N)`` the slots split into N
contiguous ranges; shard ``k`` is owned through the ``duebox_lease`` row
``shard:k/N`` (``owner``, ``epoch`` = generation, ``expires_at``).

* **Acquire**: a shard with no owner, or whose lease expired more than the
  clock-skew margin ago, is taken with one conditional ``UPDATE`` that bumps
  the generation; two relays racing for it cannot both match.
* **Renew** every pass, conditional on owner *and* generation; a renewal
  that matches nothing means the shard was lost, and the relay forgets it.
* **Fence**: every claim and every ``ENQUEUED`` mark carries
  ``EXISTS (lease row with this owner, this generation, expires_at > now)``.
  A relay paused past its lease (SIGSTOP, a long GC) and resumed finds no row
  once another relay took the shard: its claims take nothing and its marks
  change nothing.  Before publishing, the relay re-reads its leases and drops
  jobs of shards it no longer holds (:meth:`ShardOwner.verify`), so a
  resumed relay does not even publish the duplicates consumers would drop.
* **Rebalance**: a relay aims at ``ceil(N / live relays)`` shards (live:
  heartbeat rows).  It takes a shard whose owner's lease ran out whatever
  its target (a crashed relay's range is never left without an owner for
  longer than the lease), unowned shards while below the target, and gives
  an excess shard back only while another live relay holds fewer than the
  target, so that relay picks it up on its next pass.  Without a lease, nobody acts on a range;
  with one, exactly one relay can.

A relay acts on a shard only until ``acquired + ttl - margin`` by its own
monotonic clock, and others take it only after ``expires_at + margin`` by
theirs, so clock skew up to the margin cannot make two owners act at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Connection, Engine, and_, exists, func, or_, select, update
from sqlalchemy.exc import IntegrityError

from duebox.db import bound_idle_transaction, db_errors
from duebox.errors import ConfigurationError
from duebox.metrics import Metrics
from duebox.tables import SHARD_SLOTS, job, lease, shard_of


@dataclass(frozen=True)
class ShardConfig:
    """``count`` shards (1 to 1024); leases last ``ttl`` seconds."""

    count: int
    ttl: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) \
                or not 1 <= self.count <= SHARD_SLOTS:
            raise ConfigurationError(
                f"shards: must be an integer from 1 to {SHARD_SLOTS} (got {self.count!r})")
        if isinstance(self.ttl, bool) or not isinstance(self.ttl, int | float) or self.ttl <= 0:
            raise ConfigurationError(f"shard_ttl: must be a number > 0 (got {self.ttl!r})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ShardConfig | None:
        """``DUEBOX_SHARDS`` (unset or 0: no sharding) and ``DUEBOX_SHARD_TTL``."""
        env = os.environ if environ is None else environ
        raw, ttl = env.get("DUEBOX_SHARDS", ""), env.get("DUEBOX_SHARD_TTL", "")
        try:
            count = int(raw) if raw else 0
            lease_ttl = float(ttl) if ttl else 10.0
        except ValueError:
            raise ConfigurationError(
                f"DUEBOX_SHARDS / DUEBOX_SHARD_TTL: must be numbers (got {raw!r}, {ttl!r})"
            ) from None
        return cls(count, lease_ttl) if count else None

    def slots(self, k: int) -> tuple[int, int]:
        """Shard ``k``'s slot range, ``[lo, hi)``."""
        return k * SHARD_SLOTS // self.count, (k + 1) * SHARD_SLOTS // self.count

    def shard_for(self, slot: int) -> int:
        """The shard whose range holds ``slot`` (the inverse of :meth:`slots`)."""
        return ((slot + 1) * self.count - 1) // SHARD_SLOTS

    def name(self, k: int) -> str:
        return f"shard:{k}/{self.count}"


@dataclass(frozen=True, slots=True)
class Owned:
    shard: int
    generation: int
    valid_until: float  # this process's monotonic clock


def _live_relays(conn: Connection, now: datetime) -> int:
    return int(conn.execute(
        select(func.count()).select_from(lease)
        .where(lease.c.name.like("relay:%"), lease.c.expires_at > now)
    ).scalar_one())


class ShardOwner:
    """One relay's shard leases (its pipelines' claims and marks carry
    :meth:`fence`)."""

    def __init__(self, config: ShardConfig, owner: str, margin: float) -> None:
        self.config = config
        self.owner = owner
        self.margin = margin
        self.owned: dict[int, Owned] = {}
        self.lost = 0  # shards this relay found taken from it (metrics)
        self._lost_counted = 0

    # --- the lease steps ---------------------------------------------------------

    def step(self, engine: Engine, now: datetime, busy: Iterable[int] = ()) -> None:
        """Renew, give back excess, acquire: once per relay pass.  ``busy``:
        shards with work still in flight, never given back."""
        with db_errors("shard leases"), engine.begin() as conn:
            # A relay paused inside this transaction (SIGSTOP, a GC pause)
            # holds the lease rows it updated: every other relay's acquire
            # waited for it, forever (tests/test_shards.py's paused relay, 1
            # run in ~20 under load).  The server ends such a session after
            # the lease's ttl: its renewal is worthless by then anyway.
            bound_idle_transaction(conn, self.config.ttl)
            self._renew(conn, now)
            target = math.ceil(self.config.count / max(1, _live_relays(conn, now)))
            self._give_back(conn, now, target, set(busy))
            self._acquire(conn, now, target)

    def _renew(self, conn: Connection, now: datetime) -> None:
        until = now + timedelta(seconds=self.config.ttl)
        for k, o in list(self.owned.items()):
            ok = time.monotonic() < o.valid_until and conn.execute(
                update(lease).where(self._mine(k, o.generation), lease.c.expires_at > now)
                .values(expires_at=until)
            ).rowcount == 1
            if ok:
                self.owned[k] = Owned(k, o.generation, self._valid_until())
            else:
                del self.owned[k]
                self.lost += 1

    def _give_back(self, conn: Connection, now: datetime, target: int, busy: set[int]) -> None:
        if len(self.owned) <= target:
            return
        held = conn.execute(
            select(lease.c.owner, func.count()).where(
                lease.c.name.like("shard:%"), lease.c.name.like(f"%/{self.config.count}"),
                lease.c.owner.is_not(None), lease.c.expires_at > now)
            .group_by(lease.c.owner)).all()
        counts = {str(o): int(n) for o, n in held}
        live = _live_relays(conn, now)
        wanting = live > len(counts) or any(n < target for o, n in counts.items()
                                            if o != self.owner)
        if not wanting:
            return
        idle = [k for k in sorted(self.owned, reverse=True) if k not in busy]
        for k in idle[: len(self.owned) - target]:
            o = self.owned.pop(k)
            conn.execute(update(lease).where(self._mine(k, o.generation))
                         .values(owner=None, expires_at=None))

    def _acquire(self, conn: Connection, now: datetime, target: int) -> None:
        """Take shards whose owner's lease ran out (always: nobody else may
        act on them), and unowned ones while below ``target``."""
        until = now + timedelta(seconds=self.config.ttl)
        stale = now - timedelta(seconds=self.margin)
        names = [self.config.name(k) for k in range(self.config.count)]
        present = set(conn.execute(select(lease.c.name).where(lease.c.name.in_(names))).scalars())
        for k in range(self.config.count):
            if k in self.owned:
                continue
            name = self.config.name(k)
            if name not in present:
                try:
                    with conn.begin_nested():
                        conn.execute(lease.insert().values(name=name, owner=None, epoch=0))
                except IntegrityError:
                    pass
            expired = and_(lease.c.owner.is_not(None),
                           or_(lease.c.expires_at.is_(None), lease.c.expires_at < stale))
            free = or_(expired, lease.c.owner.is_(None)) if len(self.owned) < target else expired
            row = conn.execute(
                update(lease).where(lease.c.name == name, free)
                .values(owner=self.owner, epoch=lease.c.epoch + 1, expires_at=until,
                        info={"slots": list(self.config.slots(k))})
                .returning(lease.c.epoch)
            ).first() if conn.dialect.update_returning else self._acquire_no_returning(
                conn, name, free, until)
            if row is not None:
                self.owned[k] = Owned(k, int(row[0]), self._valid_until())

    def _acquire_no_returning(self, conn: Connection, name: str, free: ColumnElement[bool],
                              until: datetime) -> tuple[int] | None:
        n = conn.execute(update(lease).where(lease.c.name == name, free)
                         .values(owner=self.owner, epoch=lease.c.epoch + 1, expires_at=until)
                         ).rowcount
        if n != 1:
            return None
        return (int(conn.execute(select(lease.c.epoch).where(lease.c.name == name)).scalar_one()),)

    def release_all(self, engine: Engine) -> None:
        """On a clean stop: give every shard back at once."""
        with db_errors("shard leases"), engine.begin() as conn:
            for k, o in self.owned.items():
                conn.execute(update(lease).where(self._mine(k, o.generation))
                             .values(owner=None, expires_at=None))
        self.owned.clear()

    # --- fencing -------------------------------------------------------------------

    def _valid_until(self) -> float:
        return time.monotonic() + self.config.ttl - self.margin

    def _mine(self, k: int, generation: int) -> ColumnElement[bool]:
        return and_(lease.c.name == self.config.name(k), lease.c.owner == self.owner,
                    lease.c.epoch == generation)

    def fence(self, now: datetime) -> ColumnElement[bool]:
        """Rows of shards this relay holds, *and* holds still at ``now`` by
        the database's lease rows: the condition on every claim and mark.
        With nothing owned, it matches no row."""
        parts = []
        for k, o in sorted(self.owned.items()):
            if time.monotonic() >= o.valid_until:
                continue
            lo, hi = self.config.slots(k)
            held = exists().where(self._mine(k, o.generation), lease.c.expires_at > now)
            parts.append(and_(job.c.shard >= lo, job.c.shard < hi, held))
        return or_(*parts) if parts else job.c.shard < 0

    def verify(self, engine: Engine, now: datetime) -> set[int]:
        """The shards this relay still holds, read from the database now."""
        valid = {k for k, o in self.owned.items() if time.monotonic() < o.valid_until}
        if not valid:
            return set()
        with db_errors("shard leases"), engine.connect() as conn:
            rows = conn.execute(select(lease.c.name, lease.c.epoch).where(
                lease.c.name.in_([self.config.name(k) for k in valid]),
                lease.c.owner == self.owner, lease.c.expires_at > now)).all()
        current = {str(n): int(e) for n, e in rows}
        return {k for k in valid if current.get(self.config.name(k)) == self.owned[k].generation}

    def shard_of_job(self, job_id: uuid.UUID) -> int:
        return self.config.shard_for(shard_of(job_id))

    def observe(self, m: Metrics) -> None:
        """Gauges of the shards this relay holds, and the count it lost."""
        m.shards_owned.labels(self.owner).set(len(self.owned))
        for k in range(self.config.count):
            o = self.owned.get(k)
            if o is not None:
                m.shard_generation.labels(self.owner, str(k)).set(o.generation)
            else:
                with contextlib.suppress(KeyError):
                    m.shard_generation.remove(self.owner, str(k))
        if self.lost > self._lost_counted:
            m.shards_lost.labels(self.owner).inc(self.lost - self._lost_counted)
            self._lost_counted = self.lost
