"""Workload B of one duebox system, looked at closely: where its lateness
comes from at a steady trickle (issue #20).

    PY=~/.cache/duebox/bench-peers-venv/bin/python   # the venv run.py builds
    $PY bench/peers/trickle.py duebox-redis             # 5,000 jobs over 10 s: 500/s
    $PY bench/peers/trickle.py duebox-amqp --jobs 1000  # 100/s
    $PY bench/peers/trickle.py duebox-sql --runs 3
    $PY bench/peers/trickle.py duebox-kafka --jobs 1000  # starts the harness's Kafka mock

The same processes and environment as ``run.py``'s workload B (fresh
database, namespace and record directory; the jobs enqueued in one
transaction, due evenly over ``--spread`` seconds from 2 s on).  Per run it prints lateness
p50/p99/max and early starts, the median and max lateness of each second of
due times (a stall shows as one bad second, a backlog as a rising line),
the CPU seconds of every process while the jobs ran (bench/peers/cpu.py),
and the database's transactions and job-table row versions (from
``pg_stat_database`` and ``pg_stat_user_tables``: how many transactions
and row versions the path writes per job).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psycopg
import record
from cpu import CpuMeter
from harness import kafka_mock
from resources import environment
from systems import SYSTEMS, System
from workloads import Context, Processes, _env, _run, _wait

LEAD = 2.0  # seconds from the enqueue to the first due time, as workload B


def trickle(name: str, jobs: int, spread: float) -> None:
    system = next(s for s in SYSTEMS if s.name == name)
    with kafka_mock(system.broker == "kafka") as kafka:
        _trickle(system, jobs, spread, kafka)


def _trickle(system: System, jobs: int, spread: float, kafka: str | None) -> None:
    name = system.name
    ctx = Context(kafka=kafka, sqs=None, logs=Path(tempfile.mkdtemp(prefix="trickle-logs-")))
    rec = tempfile.mkdtemp(prefix="trickle-rec-")
    with environment(system, kafka, None, rec) as base:
        env = _env(system, base, aggressive=False)
        _run(system, env, "setup")
        procs = Processes(system, env, ctx, "trickle")
        try:
            _run(system, env, "enqueue", "--warmup")
            _wait(rec, 1, procs, timeout=120)
            meter = CpuMeter(system.broker, env["BENCH_PG_URL"],
                             {n: p.pid for n, p in procs.procs})
            _run(system, env, "enqueue", "--n", str(jobs), "--lead", str(LEAD),
                 "--spread", str(spread))
            meter.start()
            _wait(rec, jobs + 1, procs, timeout=LEAD + spread + 90)
            meter.stop()
            time.sleep(1.0)  # PostgreSQL publishes a backend's counters within a second
            with psycopg.connect(env["BENCH_PG_URL"]) as c:
                xacts = c.execute("SELECT xact_commit FROM pg_stat_database "
                                  "WHERE datname = current_database()").fetchone()
                versions = c.execute("SELECT n_tup_upd FROM pg_stat_user_tables "
                                     "WHERE relname = 'duebox_job'").fetchone()
        finally:
            procs.stop()
    rows = sorted((d, s) for d, s in record.read(rec) if d > 0)
    late = [(s - d) * 1000 for d, s in rows]
    q = statistics.quantiles(late, n=100)
    print(f"{name}: {jobs:,} jobs over {spread:g} s: lateness p50 {q[49]:.1f} p99 {q[98]:.1f} "
          f"max {max(late):.1f} ms, early {sum(1 for x in late if x < 0)}")
    by_second: dict[int, list[float]] = {}
    for (due, _), ms in zip(rows, late, strict=True):
        by_second.setdefault(int(due - rows[0][0]), []).append(ms)
    print("  by second of due time, median/max ms: " + " ".join(
        f"{k}:{statistics.median(v):.0f}/{max(v):.0f}" for k, v in sorted(by_second.items())))
    cpu = {k: round(v, 2) for k, v in meter.by_process_s.items()}
    print(f"  CPU s: {cpu}, PostgreSQL {meter.database_s:.2f}, broker {meter.broker_s:.2f}")
    if xacts and versions:
        print(f"  per job: {xacts[0] / jobs:.2f} transactions (all of the run's), "
              f"{versions[0] / jobs:.2f} job-row updates")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("system", choices=[s.name for s in SYSTEMS if s.is_duebox])
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--spread", type=float, default=10.0)
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args()
    for _ in range(args.runs):
        trickle(args.system, args.jobs, args.spread)


if __name__ == "__main__":
    main()
