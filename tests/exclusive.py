"""Tests that must run alone while the suite runs in parallel (pytest-xdist).

The suite runs in several worker processes (pyproject's ``-n auto``; the
count is ``pytest_xdist_auto_num_workers`` in conftest.py).  Each worker is
its own test session, so it has its own PostgreSQL and MariaDB database,
RabbitMQ vhost, LocalStack and Kafka mock, and every test its own Redis key
prefix.  What workers still share are the machine's servers themselves: a
test that stops or restarts one of them (``rabbitmqctl stop_app``), or
enables or disables a RabbitMQ plugin, would break whatever another worker
runs on it at that moment.  Such a test is marked
``@pytest.mark.exclusive`` and runs while no other test of the run does.

How: a readers-writer lock on two files shared by the run's workers.  Every
test holds it shared for its whole protocol (setup, call, teardown, so a
session fixture created or torn down on the way is inside too); an
exclusive test holds it exclusively.  An exclusive test waits first at a
gate that new tests also pass through, so the other workers' tests cannot
keep it waiting for ever: it waits for at most the tests already running.
The files live in a folder the controller makes for the run and names in
``DUEBOX_TEST_RUN_LOCK`` before it starts the workers (who inherit it); a
run without workers (``-n 0``, ``--pdb``) is one process and takes no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

MARKER = "exclusive"
VARIABLE = "DUEBOX_TEST_RUN_LOCK"


def make_folder() -> None:
    """In the controller of a parallel run, before its workers start."""
    os.environ[VARIABLE] = tempfile.mkdtemp(prefix="duebox-test-run-")


def remove_folder() -> None:
    """In the controller, once its workers are gone."""
    folder = os.environ.pop(VARIABLE, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


class RunLock:
    """The readers-writer lock of one parallel run (flock(2): released by
    the kernel when a worker dies, so a killed worker blocks nobody)."""

    def __init__(self, folder: Path) -> None:
        self._gate = folder / "gate"
        self._tests = folder / "tests"

    @staticmethod
    @contextlib.contextmanager
    def _held(path: Path, how: int) -> Iterator[IO[bytes]]:
        with path.open("ab") as f:
            fcntl.flock(f, how)
            try:
                yield f
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        # Through the gate (held by an exclusive test while it waits and
        # runs), then the tests lock alongside the other running tests.
        with self._held(self._gate, fcntl.LOCK_EX):
            tests = self._tests.open("ab")
            fcntl.flock(tests, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(tests, fcntl.LOCK_UN)
            tests.close()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._held(self._gate, fcntl.LOCK_EX), self._held(self._tests, fcntl.LOCK_EX):
            yield


def for_this_worker() -> RunLock | None:
    """The run's lock in an xdist worker; None in a run without workers."""
    folder = os.environ.get(VARIABLE)
    if not folder or "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    return RunLock(Path(folder))
