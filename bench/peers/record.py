"""What every peer's no-op job does: write one fixed-width line (due time,
start time; Unix seconds) to a file of its own process in BENCH_RECORD_DIR.

A plain O_APPEND write costs a few microseconds and needs no service, so it
loads no system under test more than another; fixed-width lines let the
harness count finished jobs from file sizes alone.
"""

from __future__ import annotations

import os
import threading
import time

LINE = 36  # "%017.6f %017.6f\n"
_fds: dict[tuple[int, int], int] = {}


def record(due: float) -> None:
    started = time.time()  # first: nothing of ours is counted as lateness
    key = (os.getpid(), threading.get_ident())
    fd = _fds.get(key)
    if fd is None:  # one file per process and thread: no interleaved writes
        path = os.path.join(os.environ["BENCH_RECORD_DIR"], f"{key[0]}-{key[1]}.rec")
        fd = _fds[key] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, b"%017.6f %017.6f\n" % (due, started))


def count(directory: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(directory)) // LINE


def read(directory: str) -> list[tuple[float, float]]:
    rows: list[tuple[float, float]] = []
    for entry in os.scandir(directory):
        with open(entry.path, "rb") as f:
            for line in f.read().splitlines():
                due, started = line.split()
                rows.append((float(due), float(started)))
    return rows
