"""The relay trial of two duebox trees, alternating, on the same services: a
before/after comparison measured in one run (issue #20).

    python bench/relay_ab.py BACKEND N PAIRS BEFORE_PYTHON [AFTER_PYTHON]

BEFORE_PYTHON (and AFTER_PYTHON, default: this interpreter) are the
interpreters of two virtual environments with duebox installed from the
trees to compare, e.g. ``../base/.venv/bin/python``.  Both run *this*
tree's ``bench/backends_trials.py relay`` (harness, ceiling and raw
baseline the same), each trial in a fresh process and a namespace of its
own, in the order before, after, after, before, ...: what the machine's
load does to one side it does to the other.  Prints each trial's relay
jobs/s, relay process CPU µs per job, PostgreSQL ceiling rows/s, raw
broker msg/s, relay ÷ ceiling and the 1-minute load average, then the
medians.  On a shared machine the CPU per job and relay ÷ ceiling are the
figures that hold; the rates move with the load.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import backends_services
from run import DEFAULT_PG, pg_database

TRIAL = Path(__file__).resolve().parent / "backends_trials.py"


def main(argv: list[str]) -> None:
    backend, n, pairs, before, *rest = argv
    sides = {"before": before, "after": rest[0] if rest else sys.executable}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    with backends_services.service(backend) as address, pg_database(
            os.environ.get("DUEBOX_BENCH_PG", DEFAULT_PG)) as db:
        for i in range(int(pairs)):
            for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                with backends_services.namespace(backend, address) as url:
                    done = subprocess.run([sides[name], str(TRIAL), "relay", backend, db, url, n],
                                          capture_output=True, text=True,
                                          cwd=TRIAL.parent.parent)
                if done.returncode:
                    print(name, "FAILED", done.stderr[-2000:], flush=True)
                    continue
                r = json.loads(done.stdout.strip().splitlines()[-1])
                row = {"jobs/s": r["relay"]["rate"], "cpu_us/job": r["relay"]["cpu_ms_per_job"]
                       * 1000.0, "ceiling": r["pg_floor"]["rate"], "raw": r["raw"]["rate"],
                       "relay/ceiling": r["relay"]["rate"] / r["pg_floor"]["rate"],
                       "load": os.getloadavg()[0]}
                rows[name].append(row)
                print(name, {k: round(v, 2) for k, v in row.items()}, flush=True)
    for name, got in rows.items():
        if got:
            print(name, "median", {k: round(statistics.median(r[k] for r in got), 3)
                                   for k in got[0]})


if __name__ == "__main__":
    main(sys.argv[1:])
