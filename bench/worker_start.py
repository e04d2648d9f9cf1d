"""What ``duebox worker --processes N`` costs before its first job: CPU time
and resident memory of the supervisor and each child, from /proc.

    python bench/worker_start.py --database-url postgresql+psycopg://.../db \\
        --processes 1 2 --repeats 3

The database must have duebox's tables (``duebox db upgrade``); the app is
tests/apps/cli_app.py (one no-op task), the broker ``sql://``. Each run
starts the command in a session of its own, waits until every worker
process has logged its start, waits 2 s more, and reads utime + stime and
VmRSS of every process in that session; the runs alternate between the
process counts, so the machine's load falls on each alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def _session(pgid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    found.append(int(name))
            except ProcessLookupError:
                continue
    return found


def _cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / TICK


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def one_start(database_url: str, processes: int) -> tuple[float, list[float]]:
    """(CPU ms of all its processes, RSS MiB of each) once every worker started."""
    env = {**os.environ, "DUEBOX_DATABASE_URL": database_url, "DUEBOX_BROKER_URL": "sql://"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "duebox", "worker", "--app", "tests.apps.cli_app:app",
         f"--processes={processes}"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        assert proc.stderr is not None
        started = 0
        for line in proc.stderr:
            started += " started: queues " in line
            if started == processes:
                break
        else:
            raise SystemExit(f"the worker exited with {proc.wait()} before it started")
        time.sleep(2)
        pids = _session(proc.pid)
        return sum(_cpu_ms(p) for p in pids), [_rss_mib(p) for p in pids]
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", required=True)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    cpu: dict[int, list[float]] = {n: [] for n in args.processes}
    rss: dict[int, list[float]] = {n: [] for n in args.processes}
    for _ in range(args.repeats):
        for n in args.processes:
            ms, sizes = one_start(args.database_url, n)
            cpu[n].append(ms)
            rss[n] += sizes
    for n in args.processes:
        print(f"--processes {n}: CPU to start {statistics.median(cpu[n]):,.0f} ms (median; "
              f"runs {', '.join(f'{x:,.0f}' for x in cpu[n])}), "
              f"{len(rss[n]) // args.repeats} processes of {statistics.median(rss[n]):.0f} MiB")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
