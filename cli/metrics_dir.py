"""One metrics endpoint for ``duebox worker --processes N``: the children's sums.

Each child records its counters and histograms as always; with
``PROMETHEUS_MULTIPROC_DIR`` set in its environment, prometheus-client keeps
them in files of that directory (one per process and kind), and the
supervisor serves what :class:`~prometheus_client.multiprocess.MultiProcessCollector`
adds up over them. A dead child's counters stay in the sums (they must never
go down); its ``live*`` gauges go with it (:meth:`MetricsDir.mark_dead`; the
gauges' modes are chosen in core/metrics.py).

The directory is this supervisor's own, new for every run: files left by an
earlier run can never be added in. A supervisor that was SIGKILLed leaves
its directory behind; the next one removes it. Each directory holds a lock
file, ``flock``-ed for the supervisor's life and released by the kernel when
it dies, created under another name and renamed once locked, so a directory
is removed only when its lock file exists and can be taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

log = logging.getLogger("duebox.supervisor")

PREFIX = "duebox-metrics-"
LOCK = ".supervisor.lock"


def _lock(path: Path) -> int | None:
    """``path`` opened and exclusively locked (the fd), or None if another
    process holds it or it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep(base: Path) -> list[Path]:
    """Remove the metrics directories under ``base`` whose supervisor is gone
    (their lock file is there and free); the ones removed."""
    removed = []
    for path in base.glob(PREFIX + "*"):
        fd = _lock(path / LOCK)
        if fd is None:
            continue  # alive, or not ours
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d metrics directories left by stopped supervisors", len(removed))
    return removed


class MetricsDir:
    """This supervisor's directory: give :attr:`env` to every child."""

    def __init__(self, base: Path | None = None) -> None:
        base = Path(base or tempfile.gettempdir())
        sweep(base)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
        fresh = self.path / (LOCK + ".new")
        fresh.touch(mode=0o600)
        fd = _lock(fresh)
        if fd is None:  # a directory of our own, just made: nobody else has it
            raise OSError(f"cannot lock {fresh}")
        fresh.rename(self.path / LOCK)
        self._fd: int | None = fd

    @property
    def env(self) -> dict[str, str]:
        return {"PROMETHEUS_MULTIPROC_DIR": str(self.path)}

    def registry(self) -> CollectorRegistry:
        """A registry serving the sums over every child's files."""
        registry = CollectorRegistry(auto_describe=True)
        MultiProcessCollector(registry, path=str(self.path))  # type: ignore[no-untyped-call]
        return registry

    def mark_dead(self, pid: int) -> None:
        """A child has exited: its ``live*`` gauges leave the sums."""
        with contextlib.suppress(OSError):
            mark_process_dead(pid, str(self.path))  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
