"""What every peer's no-op job does: write one fixed-width line (due time,
start time; Unix seconds) to a file of its own process in BENCH_RECORD_DIR.

A plain O_APPEND write costs a few microseconds and needs no service, so it
loads no system under test more than another; fixed-width lines let the
harness count finished jobs from file sizes alone.

A job that sleeps (workload C's slow ones) records first, then sleeps, so its
line is its start; it records under the tag ``slow`` (:func:`tag_for`), which
keeps the fast jobs' lines apart from the slow ones' and names, with the
process id in the file name, the processes running slow jobs.
"""

from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple

LINE = 36  # "%017.6f %017.6f\n"
SLOW = "slow"
_fds: dict[tuple[int, int], int] = {}


def record(due: float, tag: str = "") -> None:
    """``tag`` (a tenant, in bench/burst9.py) names the file the line goes
    to, so lines stay fixed-width and :func:`read_tagged` can tell them apart."""
    started = time.time()  # first: nothing of ours is counted as lateness
    key = (os.getpid(), threading.get_ident(), tag)
    fd = _fds.get(key)
    if fd is None:  # one file per process, thread and tag: no interleaved writes
        path = os.path.join(os.environ["BENCH_RECORD_DIR"], f"{key[0]}-{key[1]}-{tag}.rec")
        fd = _fds[key] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, b"%017.6f %017.6f\n" % (due, started))


def tag_for(sleep: float | None) -> str:
    """The tag of a job that sleeps ``sleep`` s: ``slow``, else none."""
    return SLOW if sleep else ""


def count(directory: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(directory)) // LINE


def read(directory: str) -> list[tuple[float, float]]:
    return [(due, started) for _, due, started in read_tagged(directory)]


def read_tagged(directory: str) -> list[tuple[str, float, float]]:
    """(tag, due, started) of every line."""
    return [(line.tag, line.due, line.started) for line in read_lines(directory)]


class Line(NamedTuple):
    """One recorded start, with the process and tag of the file it is in."""

    pid: int
    tag: str
    due: float
    started: float


Key = tuple[str, str]  # one job as its line names it: (tag, due as written)


def key(tag: str, due: float) -> Key:
    """Jobs of workload C have distinct due times but for the burst's, which
    share one; ``key`` is exact where the float is not (it is the text)."""
    return tag, f"{due:017.6f}"


def starts(lines: list[Line]) -> dict[Key, list[float]]:
    """Each job's starts, first first (more than one: its handler ran again)."""
    out: dict[Key, list[float]] = {}
    for x in sorted(lines, key=lambda x: x.started):
        out.setdefault(key(x.tag, x.due), []).append(x.started)
    return out


def missing(directory: str, expected: dict[Key, int]) -> int:
    """How many of the ``expected`` jobs (key: how many share it) have not
    started yet."""
    seen = starts(read_lines(directory))
    return sum(max(0, n - len(seen.get(k, []))) for k, n in expected.items())


def read_lines(directory: str) -> list[Line]:
    rows: list[Line] = []
    for entry in os.scandir(directory):
        pid, _, tag = entry.name[:-len(".rec")].split("-", 2)
        with open(entry.path, "rb") as f:
            for line in f.read().splitlines():
                due, started = line.split()
                rows.append(Line(int(pid), tag, float(due), float(started)))
    return rows
