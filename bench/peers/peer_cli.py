"""The command line every peer module shares:

    python peer_X.py setup                       # create its tables, if any
    python peer_X.py enqueue --n N               # N jobs due now; prints JSON
    python peer_X.py enqueue --n N --lead L --spread S   # due over [L, L+S) s
    python peer_X.py enqueue --warmup [--n N]    # N jobs due now (due 0: not measured)
    python peer_X.py worker                      # one worker process, default settings
                                                 # (BENCH_AGGRESSIVE=1: fastest polling)

Workload C (mixed durations) adds to a spread:

    --slow-every K --slow S          # every K-th job sleeps S s (the K-th, 2K-th...)
    --burst B --burst-sleep S --burst-at T   # and B more sleeping S s, due together T s
                                             # into the spread

Due times are Unix seconds computed here, by the enqueuer, and travel in the
job's payload with the seconds to sleep; the job records them with its start
time (record.py), then sleeps.  Every job is of the one task ``noop``: a
no-op carries no sleep at all, so workloads A and B send what they always did.
The JSON line says when the spread starts (``first_due``) and how many jobs
sleep, for the harness to time a kill against and to tell the burst apart.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple


class Job(NamedTuple):
    """One job to enqueue: its due time (Unix s) and how long it sleeps."""

    due: float
    sleep: float = 0.0

    @property
    def args(self) -> tuple[float, ...]:
        """Positional arguments of the task: (due,) for a no-op, (due, sleep) else."""
        return (self.due, self.sleep) if self.sleep else (self.due,)

    @property
    def kwargs(self) -> dict[str, float]:
        """The same as keyword arguments (or a JSON payload)."""
        return {"due": self.due, "sleep": self.sleep} if self.sleep else {"due": self.due}


Enqueue = Callable[[list[Job], bool], str]


def aggressive() -> bool:
    return os.environ.get("BENCH_AGGRESSIVE") == "1"


def spread_jobs(first: float, n: int, spread: float, slow_every: int = 0, slow: float = 0.0,
                burst: int = 0, burst_sleep: float = 0.0, burst_at: float = 0.0) -> list[Job]:
    """``n`` jobs due evenly over ``spread`` s from ``first``, every
    ``slow_every``-th sleeping ``slow`` s, plus ``burst`` jobs sleeping
    ``burst_sleep`` s all due at ``first + burst_at``; in due order."""
    jobs = [Job(first + spread * i / n,
                slow if slow_every and (i + 1) % slow_every == 0 else 0.0) for i in range(n)]
    jobs += [Job(first + burst_at, burst_sleep)] * burst
    return sorted(jobs, key=lambda j: j.due)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["setup", "enqueue", "worker"])
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--lead", type=float, default=None)
    parser.add_argument("--spread", type=float, default=0.0)
    parser.add_argument("--warmup", action="store_true")
    parser.add_argument("--slow-every", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--burst", type=int, default=0)
    parser.add_argument("--burst-sleep", type=float, default=0.0)
    parser.add_argument("--burst-at", type=float, default=0.0)
    return parser


def _jobs(args: argparse.Namespace) -> tuple[list[Job], bool, dict[str, Any]]:
    """The jobs to enqueue, whether they are delayed, and what to print beside."""
    if args.warmup:
        return [Job(0.0)] * args.n, False, {}
    if args.lead is None:
        return [Job(time.time())] * args.n, False, {}
    first = time.time() + args.lead
    jobs = spread_jobs(first, args.n, args.spread, args.slow_every, args.slow,
                       args.burst, args.burst_sleep, args.burst_at)
    return jobs, True, {"first_due": first, "slow": sum(1 for j in jobs if j.sleep)}


def main(enqueue: Enqueue, worker: Callable[[], None],
         setup: Callable[[], None] = lambda: None) -> None:
    args = _parser().parse_args()
    if args.command == "setup":
        setup()
    elif args.command == "worker":
        worker()
    else:
        jobs, delayed, extra = _jobs(args)
        start = time.perf_counter()
        how = enqueue(jobs, delayed)
        seconds = time.perf_counter() - start
        print(json.dumps({"n": len(jobs), "seconds": seconds, "how": how, **extra}))
