"""The parallel run's own machinery (tests/exclusive.py, tests/README.md): an
``exclusive`` test runs while no other test does, between real processes
holding the lock as the xdist workers do; each worker starts its own
LocalStack and Kafka mock rather than the one its controller named."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from backends import _session_service, poll

HERE = Path(__file__).resolve().parent

HOLDER = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
import exclusive
lock = exclusive.RunLock(Path(sys.argv[2]))
with (lock.exclusive() if sys.argv[3] == "exclusive" else lock.shared()):
    print("held", flush=True)
    sys.stdin.readline()
print("released", flush=True)
"""


class Holder:
    """A process that takes the lock one way, says ``held``, and lets go
    when told to (a line on its stdin)."""

    def __init__(self, folder: Path, how: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(HERE), str(folder), how],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._said = False

    def wait_held(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        assert self.proc.wait(10) == 0

    @property
    def holds(self) -> bool:
        """Whether it has said ``held`` by now (it prints nothing before)."""
        assert self.proc.stdout is not None
        if not self._said and select.select([self.proc.stdout], [], [], 0)[0]:
            self.wait_held()
            self._said = True
        return self._said


def locks_of(pid: int) -> tuple[int, int]:
    """How many flock(2) locks process ``pid`` holds and waits for
    (/proc/locks: a waiting request's line has ``->`` before its type)."""
    held = waiting = 0
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        blocked = parts[1] == "->"
        if parts[2 if blocked else 1] == "FLOCK" and int(parts[5 if blocked else 4]) == pid:
            waiting += blocked
            held += not blocked
    return held, waiting


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        if h.proc.poll() is None:
            h.proc.kill()
        h.proc.wait(10)
        for pipe in (h.proc.stdin, h.proc.stdout):
            if pipe is not None:
                pipe.close()


def test_an_exclusive_test_waits_for_running_tests_and_keeps_new_ones_out(
        tmp_path: Path, holders: list[Holder]) -> None:
    running = Holder(tmp_path, "shared")
    holders.append(running)
    running.wait_held()
    alone = Holder(tmp_path, "exclusive")
    holders.append(alone)
    # It has the gate (so it is next) and waits for the running test.
    poll("the exclusive holder waiting", lambda: locks_of(alone.proc.pid) == (1, 1), timeout=10)
    later = Holder(tmp_path, "shared")
    holders.append(later)
    # A test that asks now waits (at the gate), holding nothing.
    poll("the later test waiting", lambda: locks_of(later.proc.pid) != (0, 0), timeout=10)
    assert locks_of(later.proc.pid) == (0, 1)
    assert not alone.holds
    running.release()
    alone.wait_held()
    # A test that asked after the exclusive one waits until it is done.
    assert not later.holds
    alone.release()
    later.wait_held()
    later.release()


def test_tests_run_beside_each_other(tmp_path: Path, holders: list[Holder]) -> None:
    first, second = Holder(tmp_path, "shared"), Holder(tmp_path, "shared")
    holders += [first, second]
    first.wait_held()
    second.wait_held()  # while the first still holds it
    first.release()
    second.release()


def test_a_killed_exclusive_holder_blocks_nobody(tmp_path: Path,
                                                 holders: list[Holder]) -> None:
    alone = Holder(tmp_path, "exclusive")
    holders.append(alone)
    alone.wait_held()
    waiting = Holder(tmp_path, "shared")
    holders.append(waiting)
    poll("the shared holder waiting", lambda: locks_of(waiting.proc.pid) == (0, 1), timeout=10)
    os.kill(alone.proc.pid, signal.SIGKILL)
    alone.proc.wait(10)
    waiting.wait_held()  # the kernel dropped the dead worker's locks
    waiting.release()


def test_restarting_rabbitmq_is_exclusive() -> None:
    from contract.test_amqp import TestAMQPContract

    marks = getattr(TestAMQPContract.test_broker_restart_loses_nothing, "pytestmark", [])
    assert "exclusive" in {m.name for m in marks}


@pytest.mark.parametrize(("env", "worker", "same"), [
    # The controller chose before it started the workers: a worker chooses anew.
    ({"X": "http://127.0.0.1:1", "X_OWN": "main"}, "gw1", False),
    # This worker chose; a process its test started inherits it.
    ({"X": "http://127.0.0.1:1", "X_OWN": "gw1"}, "gw1", True),
    # A process started with the worker's variables but not xdist's keeps it.
    ({"X": "http://127.0.0.1:1", "X_OWN": "gw1"}, None, True),
    # A service the developer named is everyone's.
    ({"X": "http://127.0.0.1:1"}, "gw1", True),
])
def test_each_worker_has_its_own_session_service(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], worker: str | None,
        same: bool) -> None:
    for name in ("X", "X_OWN", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if worker is not None:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    address, own = _session_service("X", lambda port: f"http://127.0.0.1:{port}")
    assert (address == env["X"]) is same
    assert own is ("X_OWN" in env or not same)
    assert os.environ["X"] == address
