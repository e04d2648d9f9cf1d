"""Faults at random times, each logged with its start and end.

Safe kinds touch only what the soak owns (its processes, its proxy, its
database's connections, its private redis-server or LocalStack) and are on
by default.  ``broker-restart`` on RabbitMQ and ``pg-restart`` restart shared
servers: they run only when named in ``--faults``, and the service is always
brought back in ``finally``.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from tests.backends import rabbitmqctl
from tests.hostile import Forger, hostile_mix
from tests.soak.app import LEASE_SECONDS
from tests.soak.fleet import Fleet
from tests.soak.services import HARNESS_APP_NAME, Stand, wait_until

SAFE = ("kill", "stop", "proxy-cut", "proxy-stall", "proxy-slow", "pg-drop", "hostile")
ALL = (*SAFE, "broker-flush", "broker-restart", "pg-restart", "skew")
# What the "hostile" fault writes into the broker each time (tests/hostile.py).
HOSTILE_FORGED = 40
SKEW_SECONDS = 5.0


class FaultConfigError(ValueError):
    """An unknown fault name, or one the chosen backend cannot have."""


def parse_faults(spec: str, backend: str) -> list[str]:
    """``default`` = the safe kinds (plus the private Redis's flush and
    restart on ``redis``); ``none``; or a comma-separated list of names."""
    if spec == "none":
        return []
    if spec == "default":
        kinds = [k for k in SAFE if (backend != "kafka" or not k.startswith("proxy"))
                 and (backend != "sql" or k != "hostile")]
        if backend == "redis":
            kinds += ["broker-flush", "broker-restart"]
        if backend == "sqs":  # the soak's own LocalStack
            kinds += ["broker-restart"]
        return kinds
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    for k in kinds:
        if k not in ALL:
            raise FaultConfigError(f"--faults: unknown fault {k!r} (known: {', '.join(ALL)})")
    if "broker-flush" in kinds and backend != "redis":
        raise FaultConfigError("--faults: broker-flush is for the redis backend only")
    if "broker-restart" in kinds and backend in ("sql", "kafka"):
        raise FaultConfigError(f"--faults: no broker-restart for {backend} "
                               "(sql: use pg-restart; kafka: not supported here)")
    if any(k.startswith("proxy") for k in kinds) and backend == "kafka":
        raise FaultConfigError("--faults: proxy faults need a proxy; kafka:// has none")
    if "hostile" in kinds and backend == "sql":
        raise FaultConfigError("--faults: hostile writes into a broker; sql:// has none "
                               "(its rows are the messages)")
    return kinds


@dataclass
class FaultEvent:
    kind: str
    target: str
    start: float  # wall-clock seconds (time.time())
    end: float


class Injector:
    """Runs in a thread during the load window: one fault at a time, at
    random intervals, until :meth:`stop`."""

    def __init__(self, kinds: list[str], fleet: Fleet, stand: Stand, harness: sa.Engine,
                 rng: random.Random, gap: tuple[float, float], log: Path) -> None:
        self.kinds = kinds
        self.fleet = fleet
        self.stand = stand
        self.harness = harness
        self.rng = rng
        self.gap = gap
        self.log = log
        self.skew: float | None = None  # fixed offset for "skew" (default: ±5 s at random)
        self.events: list[FaultEvent] = []
        self.errors: list[str] = []
        self.hostile_sent = 0  # bodies the "hostile" fault wrote into the broker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        if self.kinds:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(*self.gap)):
            kind = self.rng.choice(self.kinds)
            start = time.time()
            try:
                target = self._inject(kind)
            except Exception as exc:  # a fault that could not be applied is reported
                self.errors.append(f"{kind}: {exc!r}")
                continue
            self._record(FaultEvent(kind, target, start, time.time()))

    def _record(self, ev: FaultEvent) -> None:
        self.events.append(ev)
        line = (f"{time.strftime('%H:%M:%S', time.gmtime(ev.start))}"
                f".{int(ev.start % 1 * 1000):03d}Z {ev.kind:<15} {ev.target:<22} "
                f"{ev.end - ev.start:6.2f}s")
        print(f"  fault {line}", flush=True)
        with self.log.open("a") as f:
            f.write(line + "\n")

    # --- the faults -------------------------------------------------------------------

    def _inject(self, kind: str) -> str:
        # "stop" would shadow the thread's stop event: signal faults are named for the signal.
        name = {"kill": "sigkill", "stop": "sigstop"}.get(kind, kind)
        fn: Callable[[], str] = getattr(self, "_" + name.replace("-", "_"))
        return fn()

    def _pick(self) -> str:
        return self.rng.choice([s.name for s in self.fleet.slots])

    def _sigkill(self) -> str:
        slot = self.fleet.by_name(self._pick())
        victim = slot.current
        self.fleet.signal(slot, signal.SIGKILL)
        time.sleep(self.rng.uniform(0.2, 1.0))
        self.fleet.spawn(slot)
        return victim

    def _sigstop(self) -> str:
        # Longer than the lease: when it resumes, its leases are someone
        # else's and every write it still has in flight must be fenced off.
        slot = self.fleet.by_name(self._pick())
        self.fleet.signal(slot, signal.SIGSTOP)
        try:
            time.sleep(self.rng.uniform(LEASE_SECONDS + 0.5, LEASE_SECONDS + 2.5))
        finally:
            self.fleet.signal(slot, signal.SIGCONT)
        return slot.current

    def _proxy(self, mode: str) -> str:
        assert self.stand.proxy is not None
        self.stand.proxy.set_mode(mode)
        try:
            time.sleep(self.rng.uniform(1.0, 4.0))
        finally:
            self.stand.proxy.set_mode("pass")
        return f"proxy->{self.stand.backend}"

    def _proxy_cut(self) -> str:
        return self._proxy("cut")

    def _proxy_stall(self) -> str:
        return self._proxy("stall")

    def _proxy_slow(self) -> str:
        return self._proxy("slow")

    def _hostile(self) -> str:
        """Write what anyone who can reach the broker could: envelopes for
        jobs that do not exist, due in an hour, naming a queue RabbitMQ
        cannot use; JSON nested 1,000 and 5,000 deep; garbage.  Straight to
        the broker, around the proxy (a cut must not stop the forger)."""
        bodies = hostile_mix(HOSTILE_FORGED)
        with Forger(self.stand.direct_broker_url) as forger:
            forger.send_all(bodies)
        self.hostile_sent += len(bodies)
        return f"{len(bodies)} forged messages"

    def _pg_drop(self) -> str:
        """Terminate every connection to the soak's database but the harness's."""
        with self.harness.begin() as conn:
            n = conn.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND application_name <> :me"), {"me": HARNESS_APP_NAME}).scalar_one()
        return f"{n} connections"

    def _broker_flush(self) -> str:
        assert self.stand.redis is not None
        self.stand.redis.flushall()
        return "private redis"

    def _broker_restart(self) -> str:
        backend = self.stand.backend
        if backend == "redis":
            assert self.stand.redis is not None
            self.stand.redis.kill()
            try:
                time.sleep(self.rng.uniform(0.5, 2.0))
            finally:
                self.stand.redis.start()
            return "private redis (kill -9, empty)"
        if backend == "amqp":
            rabbitmqctl("stop_app")
            try:
                time.sleep(self.rng.uniform(1.0, 3.0))
            finally:
                rabbitmqctl("start_app")
                rabbitmqctl("await_startup")
            return "rabbitmq stop_app/start_app"
        if backend == "sqs":
            assert self.stand.localstack is not None
            self.stand.localstack.stop()
            try:
                time.sleep(self.rng.uniform(0.5, 2.0))
            finally:
                # start() returns once SQS answers again, or raises: reported
                # as a fault that could not be applied.
                self.stand.localstack.start()
            return "private localstack (stop, empty)"
        raise FaultConfigError(f"no broker restart for {backend}")

    def _pg_restart(self) -> str:
        cluster = sorted(p.name for p in Path("/etc/postgresql").iterdir())[-1]
        try:
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", cluster, "main",
                            "restart"], check=True, capture_output=True, timeout=120)
        finally:
            wait_until("PostgreSQL after restart", _pg_ready, 120)
        return f"postgresql {cluster}"

    def _skew(self) -> str:
        """Restart one process under libfaketime, ±5 s off, for a while."""
        slot = self.fleet.by_name(self._pick())
        skew = self.skew if self.skew is not None else self.rng.choice(
            (-SKEW_SECONDS, SKEW_SECONDS))
        self.fleet.signal(slot, signal.SIGKILL)
        self.fleet.spawn(slot, skew=skew)
        target = f"{slot.current} {skew:+g}s"
        try:
            time.sleep(self.rng.uniform(6.0, 10.0))
        finally:
            self.fleet.signal(slot, signal.SIGKILL)
            self.fleet.spawn(slot)
        return target


def _pg_ready() -> bool:
    return subprocess.run(["pg_isready", "-h", "127.0.0.1", "-q"], check=False).returncode == 0
