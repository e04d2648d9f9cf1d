"""The soak's relays and workers: separate OS processes it starts, kills,
stops, resumes and restarts by pid, with each one's peak memory.

A slot (``relay-1`` ... ``worker-3``) always has one live incarnation after
a fault: a killed process is replaced by a new one with a new name (``relay-1.2``),
so a late write from the old one can be told apart in the tables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.backends import stop_processes

ROOT = Path(__file__).resolve().parents[2]
FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")


@dataclass
class Slot:
    role: str
    name: str
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = False
    skew: float = 0.0
    peak_kib: int = 0  # VmHWM over every incarnation

    @property
    def current(self) -> str:
        return f"{self.name}.{self.incarnation}"


def vm_hwm_kib(pid: int) -> int:
    """Peak resident set size of a live process (``VmHWM``), 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class Fleet:
    database_url: str
    broker_url: str
    logs: Path
    relays: int = 3
    workers: int = 3
    slots: list[Slot] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start_all(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for role, n in (("relay", self.relays), ("worker", self.workers)):
            for i in range(1, n + 1):
                slot = Slot(role, f"{role}-{i}")
                self.slots.append(slot)
                self.spawn(slot)

    def spawn(self, slot: Slot, skew: float = 0.0) -> None:
        slot.incarnation += 1
        slot.stopped = False
        slot.skew = skew
        env = dict(os.environ)
        if skew:
            if not FAKETIME_LIB.exists():
                raise RuntimeError(f"clock skew needs libfaketime ({FAKETIME_LIB}): "
                                   "apt-get install -y faketime")
            # A constant offset on every clock the process reads (monotonic
            # included: the whole process lives in the skewed world).
            env.update(LD_PRELOAD=str(FAKETIME_LIB), FAKETIME=f"{skew:+g}s",
                       FAKETIME_NO_CACHE="1")
        log = (self.logs / f"{slot.current}.log").open("wb")
        slot.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.soak.proc", slot.role, self.database_url,
             self.broker_url, slot.current],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        )
        log.close()

    def by_name(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)

    def sample_memory(self) -> None:
        with self.lock:
            for s in self.slots:
                if s.proc is not None and s.proc.poll() is None:
                    s.peak_kib = max(s.peak_kib, vm_hwm_kib(s.proc.pid))

    def signal(self, slot: Slot, sig: signal.Signals) -> None:
        assert slot.proc is not None
        if sig == signal.SIGKILL:
            self.sample_memory()  # its last reading before it goes
        os.kill(slot.proc.pid, sig)
        if sig == signal.SIGKILL:
            slot.proc.wait(10)
        slot.stopped = sig == signal.SIGSTOP

    def died(self) -> list[str]:
        """Processes that exited without being killed by the soak: each one a failure."""
        out = []
        for s in self.slots:
            if s.proc is not None and s.proc.poll() is not None:
                out.append(f"{s.current} exited with {s.proc.returncode}: "
                           f"{self.tail(s.current)}")
        return out

    def tail(self, name: str, chars: int = 2000) -> str:
        try:
            return (self.logs / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop_all(self) -> None:
        """SIGCONT whatever is stopped, SIGTERM everything, SIGKILL what hangs."""
        stop_processes([s.proc for s in self.slots if s.proc is not None])
