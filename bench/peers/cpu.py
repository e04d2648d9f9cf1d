"""CPU time spent on one workload, read from /proc (issue #20: CPU ms per job).

Counted: the system's own processes and their children (worker, relay,
Celery's pool: each started in a session of its own, so its process group
is exactly its processes) and the servers it uses — PostgreSQL's backends
connected to the workload's own database plus its shared background
processes (WAL writer, checkpointer...), the Redis server, the RabbitMQ node
(beam.smp) and the Kafka mock or LocalStack when they serve it.  The
servers are shared with whatever else runs on the machine, so their share
is an upper bound; the system's own processes are exact.

utime + stime of every thread, in clock ticks, sampled before the worker
starts and again just before it is stopped: the difference is the work the
run cost, the enqueue excluded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import psycopg

_TICK = os.sysconf("SC_CLK_TCK")
# Server processes by command name (what /proc/PID/comm holds).
_SERVERS = {"redis": ("redis-server",), "amqp": ("beam.smp",), "kafka": (), "sqs": (),
            "pg": ()}
# PostgreSQL's own processes, shared by every database; its client backends
# are counted only when connected to the workload's database.
_PG_SHARED = ("postgres: walwriter", "postgres: checkpointer", "postgres: background writer",
              "postgres: autovacuum launcher", "postgres: logical replication launcher")


def _ticks(pid: int) -> int:
    """utime + stime of the process (all its threads), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of the line)


def _pids() -> Iterable[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def group_pids(pgids: set[int]) -> list[int]:
    """Every process of these process groups: a command the harness started
    in a session of its own and all it started (a supervisor's children)."""
    out = []
    for pid in _pids():
        try:
            if os.getpgid(pid) in pgids:
                out.append(pid)
        except ProcessLookupError:
            continue
    return out


def _broker_pids(broker: str) -> list[int]:
    names = _SERVERS.get(broker, ())
    return [pid for pid in _pids() if _read(f"/proc/{pid}/comm") in names]


def _pg_shared_pids() -> list[int]:
    return [pid for pid in _pids() if _read(f"/proc/{pid}/comm") == "postgres"
            and _read(f"/proc/{pid}/cmdline").startswith(_PG_SHARED)]


def _pg_backends(pg_url: str) -> list[int]:
    """Client backends connected to the workload's database (not this one)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                            " AND pid <> pg_backend_pid()").fetchall()
    return [r[0] for r in rows]


@dataclass
class CpuMeter:
    """Sample with ``start()`` once the system's processes exist, ``stop()``
    before they are stopped; ``per_job(n)`` then says where the time went."""

    broker: str
    pg_url: str
    pgids: dict[str, int]  # process name (relay, worker...) → its process group
    _before: dict[int, int] = field(default_factory=dict)
    by_process_s: dict[str, float] = field(default_factory=dict)
    own_s: float = 0.0
    broker_s: float = 0.0
    database_s: float = 0.0

    def start(self) -> None:
        self._before = {pid: _ticks(pid) for pid in
                        [*_broker_pids(self.broker), *_pg_shared_pids(),
                         *group_pids(set(self.pgids.values()))]}

    def _delta(self, pids: Iterable[int]) -> float:
        return sum(max(0, _ticks(p) - self._before.get(p, 0)) for p in set(pids)) / _TICK

    def stop(self) -> None:
        # Backends that connected after start() began at zero: all of their
        # time belongs to the run.
        self.by_process_s = {name: self._delta(group_pids({pgid}))
                             for name, pgid in self.pgids.items()}
        self.own_s = sum(self.by_process_s.values())
        self.database_s = self._delta([*_pg_backends(self.pg_url), *_pg_shared_pids()])
        self.broker_s = self._delta(_broker_pids(self.broker))

    def per_job(self, n: int) -> dict[str, float]:
        ms = 1000.0 / max(1, n)
        return {**{f"{name}_ms": v * ms for name, v in self.by_process_s.items()},
                "own_ms": self.own_s * ms, "database_ms": self.database_s * ms,
                "broker_ms": self.broker_s * ms,
                "total_ms": (self.own_s + self.database_s + self.broker_s) * ms}
