"""The command line every peer module shares:

    python peer_X.py setup                       # create its tables, if any
    python peer_X.py enqueue --n N               # N jobs due now; prints JSON
    python peer_X.py enqueue --n N --lead L --spread S   # due over [L, L+S) s
    python peer_X.py enqueue --warmup            # one job due now (due 0: not measured)
    python peer_X.py worker                      # one worker process, default settings
                                                 # (BENCH_AGGRESSIVE=1: fastest polling)

Due times are Unix seconds computed here, by the enqueuer, and travel in the
job's payload; the job records them with its start time (record.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

Enqueue = Callable[[list[float], bool], str]


def aggressive() -> bool:
    return os.environ.get("BENCH_AGGRESSIVE") == "1"


def main(enqueue: Enqueue, worker: Callable[[], None],
         setup: Callable[[], None] = lambda: None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["setup", "enqueue", "worker"])
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--lead", type=float, default=None)
    parser.add_argument("--spread", type=float, default=0.0)
    parser.add_argument("--warmup", action="store_true")
    args = parser.parse_args()
    if args.command == "setup":
        setup()
    elif args.command == "worker":
        worker()
    else:
        if args.warmup:
            dues, delayed = [0.0], False
        elif args.lead is None:
            dues, delayed = [time.time()] * args.n, False
        else:
            t0 = time.time()
            dues = [t0 + args.lead + args.spread * i / args.n for i in range(args.n)]
            delayed = True
        start = time.perf_counter()
        how = enqueue(dues, delayed)
        seconds = time.perf_counter() - start
        print(json.dumps({"n": len(dues), "seconds": seconds, "how": how}))
