"""PostgreSQL failover: lateness, write outage and what is lost (the RPO).

    python bench/pg_failover.py --modes sync,async --brokers sql,redis --runs 3
    python bench/pg_failover.py --modes async --lag 2 --runs 3   # a standby 2 s behind

Each run (tests/failover_scenario.py): a primary and a streaming standby of
the run's own (tests/pg_pair.py), one relay and two workers as processes on
the multi-host URL, a producer scheduling about 40 jobs/s (one per
transaction, each due within 2 s) from ``--warm`` effects on; then every
process of the primary is SIGKILLed and the standby promoted at once (no
detection delay: add your failover manager's), and the run goes on until
``--after`` jobs were scheduled on the new primary and every job it has
ran.  Nobody is paused: every takeover is a live process taken for dead.

Per run it prints:

* ``outage``: from the kill to the producer's first acknowledged commit on
  the new primary (``pg_ctl promote`` included);
* start lateness (start minus due, handler's clock) of the jobs due from 1 s
  before the kill to 5 s after it (p50 / p99 / max), and before it;
* ``lost``: jobs whose commit the producer saw return and the new primary
  does not have (schedules lost);
* ``reran``: jobs whose effect the old primary had committed and the new
  primary ran again (completions lost) — read from the old primary's data,
  started again alone on another port once the run is over;
* ``ran, then vanished``: jobs the old primary had run that the new one has
  no trace of (scheduled and run within the lag);
* ``taken for dead``: the relay's takeovers (a live worker found dead);
* ``cut``: attempts the failover cut (closed ``lost`` on the new primary),
  settled by their worker once the new primary took writes (their error
  says "the job's transaction was cut") or by recovery once their lease
  ran out;
* the invariant checks: nothing early, no effect committed twice in the
  surviving history.

``--lag S`` (asynchronous): the primary's WAL sender is paused S seconds
before the kill, so the standby is S seconds behind: the RPO of a lagging
standby.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import redis
import sqlalchemy as sa
from backends import REDIS, Keys, Procs, free_port, poll, with_params
from failover_scenario import (
    LAUNCHER,
    Producer,
    all_succeeded,
    answering,
    effect_runs,
    effects_count,
    job_states,
    prepare,
    start_processes,
    takeovers,
)
from helpers import effects
from pg_pair import PgPair, available
from recovery_scenario import percentile

from duebox.tables import attempt


def one_run(sync: bool, broker_kind: str, seed: int, args: argparse.Namespace,
            logs: Path) -> dict[str, Any]:
    prefix = f"fo{uuid.uuid4().hex[:10]}"
    broker = "sql://" if broker_kind == "sql" else with_params(REDIS, prefix=prefix)
    pair = PgPair(free_port(), free_port(), synchronous=sync)
    procs = Procs(logs, LAUNCHER)
    app = None
    try:
        pair.start()
        app = prepare(pair, broker)
        start_processes(app, procs, pair.multi_host_url(comma=True), broker, ["w1", "w2"])
        with Producer(app, seed, pause=0.025) as producer:
            poll("warm-up effects", lambda: effects_count(app) >= args.warm, timeout=60,
                 check=procs.check)
            if args.lag and not sync:
                pair.pause_wal_sender()
                time.sleep(args.lag)  # the lag itself is what is measured
            kill_us = time.time_ns() // 1000
            pair.kill_primary()
            # Once every process of the primary is gone: its backends
            # answered until then.
            killed = time.monotonic()
            pair.promote()
            promoted = time.monotonic()
            poll("jobs on the new primary",
                 answering(lambda: producer.acked_after(promoted) >= args.after),
                 timeout=120, check=procs.check)
        acked = producer.ids()
        first = producer.first_after(killed)
        have = job_states(app.engine, acked)
        kept = [i for i in acked if i in have]
        poll("every job the new primary has", answering(lambda: all_succeeded(app.engine, kept)),
             timeout=args.wait, check=procs.check)
        procs.stop_all()
        new_runs = effect_runs(app.engine)
        with app.engine.connect() as conn:
            doubled = conn.execute(sa.select(sa.func.count()).select_from(attempt).where(
                attempt.c.error.contains("duplicate key"))).scalar_one()
            early = conn.execute(sa.select(sa.func.count()).select_from(effects).where(
                effects.c.started_us < effects.c.due_us)).scalar_one()
            # Attempts the failover cut: settled by their worker once the new
            # primary took writes (it says so in the attempt's error), or
            # by recovery once their lease ran out (no error).
            lost = list(conn.execute(sa.select(attempt.c.error).where(
                attempt.c.outcome == "lost")).scalars())
        old = sa.create_engine(pair.reopen_old_primary(free_port()))
        try:
            old_runs = effect_runs(old)
        finally:
            old.dispose()
        reran = sum(1 for j, run in old_runs.items() if j in new_runs and new_runs[j] != run)
        vanished = sum(1 for j in old_runs if j not in new_runs)
        window = [s - d for d, s in new_runs.values() if kill_us - 1e6 <= d <= kill_us + 5e6]
        calm = [s - d for d, s in new_runs.values() if d < kill_us - 1e6]
        taken = takeovers(procs)
        return {
            "mode": "sync" if sync else "async", "broker": broker_kind, "seed": seed,
            "promote_s": promoted - killed,
            "outage_s": (first - killed) if first is not None else float("nan"),
            "window": window, "calm": calm, "acked": len(acked),
            "lost": len(acked) - len(kept), "unsure": len(producer.unsure), "reran": reran,
            "vanished": vanished,
            "taken_for_dead": taken, "early": int(early), "doubled": int(doubled),
            "cut_settled": sum(1 for e in lost if (e or "").startswith("the job's transaction")),
            "cut_recovered": sum(1 for e in lost
                                 if not (e or "").startswith("the job's transaction")),
        }
    finally:
        procs.stop_all()
        if app is not None:
            with contextlib.suppress(Exception):
                app.dispose()
        pair.stop()
        if broker_kind == "redis":
            with redis.Redis.from_url(REDIS) as client:
                Keys(client, prefix).wipe()


def ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) / 1000:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--brokers", default="sql,redis")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warm", type=int, default=150, help="effects before the kill")
    ap.add_argument("--after", type=int, default=200, help="jobs scheduled after the promotion")
    ap.add_argument("--lag", type=float, default=0.0,
                    help="async: seconds the standby is held behind before the kill")
    ap.add_argument("--wait", type=float, default=90.0)
    ap.add_argument("--logs", type=Path, help="keep each run's process logs under this folder")
    args = ap.parse_args()
    why_not = available()
    if why_not:
        print(why_not, file=sys.stderr)
        return 2
    print("| mode | broker | run | promote s | outage s | lateness in window p50 / p99 / max ms "
          "| before ms p50 / p99 | acked | lost | unsure | reran | ran, then vanished "
          "| taken for dead | early | doubled | cut: settled by worker / by recovery |")
    print("| --- " * 16 + "|")
    failed = False
    for mode in args.modes.split(","):
        for broker in args.brokers.split(","):
            for n in range(args.runs):
                with tempfile.TemporaryDirectory() as tmp:
                    logs = args.logs / f"{mode}-{broker}-{n}" if args.logs else Path(tmp)
                    logs.mkdir(parents=True, exist_ok=True)
                    r = one_run(mode == "sync", broker, 1000 + n, args, logs)
                w = r["window"]
                lag = f" lag {args.lag:g} s" if args.lag and mode == "async" else ""
                print(f"| {r['mode']}{lag}"
                      f" | {r['broker']} | {n + 1} | {r['promote_s']:.2f} | {r['outage_s']:.2f} "
                      f"| {ms(w, .5)} / {ms(w, .99)} / {ms(w, 1.0)} ({len(w)} jobs) "
                      f"| {ms(r['calm'], .5)} / {ms(r['calm'], .99)} | {r['acked']} | {r['lost']} "
                      f"| {r['unsure']} | {r['reran']} | {r['vanished']} | {r['taken_for_dead']} "
                      f"| {r['early']} "
                      f"| {r['doubled']} | {r['cut_settled']} / {r['cut_recovered']} |",
                      flush=True)
                failed |= bool(r["early"] or r["doubled"] or (mode == "sync" and r["lost"]))
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally blocks
    sys.exit(main())
