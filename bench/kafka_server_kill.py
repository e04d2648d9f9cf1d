"""A Kafka-protocol server (tansu, memory only) SIGKILLed mid-run and started
again empty at the same address: tests/kafka_server_kill.py's scenario,
repeated, on a fresh PostgreSQL database per run.

    python bench/kafka_server_kill.py --runs 3

Per run it prints what ran, what did not (by state), and the start lateness
measured from ``max(due, restart)``, overall and for the jobs due while the
server was down (bench/SOAK.md, "Failover: Kafka, the server killed
(tansu)").  Exits 1 if a run lost, doubled or started early a job.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kafka_server_kill import run
from recovery_scenario import fresh_database


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--outage", type=float, default=2.0, help="seconds the server is down")
    ap.add_argument("--wait", type=float, default=60.0,
                    help="seconds after the restart for every job to finish")
    args = ap.parse_args()
    bad = 0
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp, fresh_database("postgres", Path(tmp)) as url:
            out = run(url, Path(tmp) / "run", outage=args.outage, wait=args.wait)
        print(f"run {i + 1}: {out.line()}", *out.notes, sep="\n  ", flush=True)
        bad += out.unfinished > 0 or out.double_effects > 0 or out.early > 0
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
