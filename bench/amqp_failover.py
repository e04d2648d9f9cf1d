"""A RabbitMQ cluster failover, measured: tests/test_amqp_cluster.py's run
(tests/cluster_failover.py) with a choice of delay mode, job count and
``redeliver_after``, printing what ran and how late (bench/SOAK.md,
"Failover").

    python bench/amqp_failover.py --mode tiers
    python bench/amqp_failover.py --mode plugin --redeliver-after 5

``--mode plugin`` enables rabbitmq_delayed_message_exchange on the
cluster's nodes: the delayed messages wait on the node that is killed, so
the job table must republish them (after ``redeliver_after``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster_failover import describe, failover
from helpers import check_no_early_start, effect_rows, make_app, states
from recovery_scenario import fresh_database
from services.rabbit_cluster import rabbit_cluster

PLUGIN = "rabbitmq_delayed_message_exchange"


async def measure(args: argparse.Namespace, database_url: str) -> int:
    query = ("queue_type=quorum&delay_mode=tiers" if args.mode == "tiers"
             else "queue_type=quorum&delay_mode=plugin")
    with rabbit_cluster(3, plugins=(PLUGIN,) if args.mode == "plugin" else ()) as cluster:
        app = make_app(database_url, cluster.url(query=query), lease_seconds=30.0,
                       redeliver_after=args.redeliver_after)
        run = await failover(app, cluster, jobs=args.jobs, first_due=args.first_due,
                             spread=args.spread, wait=args.wait)
        rows = effect_rows(app.engine)
        republished = sum(1 for r in rows.values() if r.attempt > 1)
        print(f"{args.mode}: killed {run.victim} {(run.killed_at - run.start).total_seconds():.1f}"
              f" s after scheduling; all {args.jobs} jobs done {run.done_after:.1f} s later")
        print(f"effects {len(rows)} of {args.jobs + 1}; final states {states(app.engine)}; "
              f"effects with attempt > 1: {republished}")
        check_no_early_start(app.engine)
        for what, ms in run.lateness(app):
            print(f"lateness, {what}: {describe(ms)}")
        app.engine.dispose()
        return 0 if len(rows) == args.jobs + 1 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["tiers", "plugin"], default="tiers")
    ap.add_argument("--jobs", type=int, default=240)
    ap.add_argument("--first-due", type=float, default=6.0)
    ap.add_argument("--spread", type=float, default=12.0)
    ap.add_argument("--redeliver-after", type=float, default=900.0)
    ap.add_argument("--wait", type=float, default=120.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, fresh_database("postgres", Path(tmp)) as url:
        return asyncio.run(measure(args, url))


if __name__ == "__main__":
    sys.exit(main())
