"""The chaos soak: ``python -m tests.soak --backend sql --ci`` (see docs/soak.md).

3 relays and 3 workers as separate processes against PostgreSQL and one
backend; a load of delayed, retried, cancelled and rescheduled jobs plus a
recurring schedule; faults at random times; then a drain and an exact verdict.
Exit status 0 only when nothing was lost, doubled, early, run after its
cancel or written under a stale lease, and no process died on its own.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from duebox.tables import job
from tests.soak.app import build_app, plan
from tests.soak.faults import FaultConfigError, Injector, parse_faults
from tests.soak.fleet import Fleet
from tests.soak.load import Driver
from tests.soak.services import BACKENDS, SoakSetupError, Stand
from tests.soak.verdict import ACTIVE, explain, judge, render

CI_SECONDS = 40
CI_JOBS = 2400
CI_MAX_DELAY = 4.0
LONG_MAX_DELAY = 10.0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default="sql")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--ci", action="store_true",
                      help=f"short mode: {CI_SECONDS} s of load, {CI_JOBS} jobs (the default)")
    mode.add_argument("--minutes", type=float, help="long mode: minutes of load")
    p.add_argument("--jobs", type=int, help="jobs to schedule (long mode default: 100000)")
    p.add_argument("--max-delay", type=float,
                   help="the broker ceiling (?max_delay=); delays go to 1.5x this")
    p.add_argument("--faults", default="default",
                   help="'default' (safe kinds), 'none', or names: kill,stop,proxy-cut,"
                        "proxy-stall,proxy-slow,pg-drop,hostile,broker-flush,broker-restart,"
                        "pg-restart,skew (the last three touch shared servers or need "
                        "libfaketime: only when named)")
    p.add_argument("--fault-gap", type=float, nargs=2, metavar=("MIN", "MAX"),
                   help="seconds between faults (default: 2 5; long mode 8 20, so the "
                        "system spends most of the time recovering, not faulted)")
    p.add_argument("--drain", type=float,
                   help="seconds to wait after the load for every job to finish "
                        "(default: 60 + 3 x ceiling; long mode 180 + 3 x ceiling)")
    p.add_argument("--skew", type=float,
                   help="the skew fault's clock offset in seconds (default: +5 or -5 at random)")
    p.add_argument("--kafka-mock-as-is", action="store_true",
                   help="kafka: leave the mock's SyncGroup as it is (a follower syncing "
                        "after the leader fails with INVALID_REQUEST; see "
                        "tests/services/kafka_mock.py)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--report", type=Path, help="append the verdict as Markdown to this file")
    p.add_argument("--keep-logs", type=Path, help="write process logs here (default: temp)")
    args = p.parse_args(argv)
    if args.minutes is not None and args.minutes <= 0:
        p.error("--minutes: must be > 0")
    if args.jobs is not None and args.jobs < 1:
        p.error("--jobs: must be >= 1")
    if args.max_delay is not None and args.max_delay <= 0:
        p.error("--max-delay: must be > 0")
    try:
        args.fault_kinds = parse_faults(args.faults, args.backend)
    except FaultConfigError as exc:
        p.error(str(exc))
    return args


def remaining(engine: sa.Engine) -> int:
    """Jobs that should still run: planned, not cancelled, not finished; and
    any recurring occurrence not finished."""
    with engine.connect() as conn:
        return int(conn.execute(
            sa.select(sa.func.count()).select_from(job)
            .outerjoin(plan, plan.c.job_id == job.c.id)
            .where(job.c.state.in_(ACTIVE), sa.func.coalesce(plan.c.cancelled, False).is_(False))
        ).scalar_one())


INTERRUPTED = threading.Event()


def _interrupt(signum: int, frame: object) -> None:
    # Also remembered: a KeyboardInterrupt raised inside a database call can
    # be swallowed on the way out (seen once), and the driver checks this flag.
    INTERRUPTED.set()
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    args = parse(argv)
    # Stopped by SIGINT or SIGTERM (even when started in the background, where
    # SIGINT is ignored), the soak still stops its processes and drops its
    # database, vhost and private redis-server on the way out.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    seconds = CI_SECONDS if args.minutes is None else args.minutes * 60
    jobs = args.jobs or (CI_JOBS if args.minutes is None else 100_000)
    max_delay = args.max_delay or (CI_MAX_DELAY if args.minutes is None else LONG_MAX_DELAY)
    gap = tuple(args.fault_gap or ((2.0, 5.0) if args.minutes is None else (8.0, 20.0)))
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    logs = args.keep_logs or Path(tempfile.mkdtemp(prefix="duebox-soak-"))
    logs.mkdir(parents=True, exist_ok=True)
    command = "python -m tests.soak " + " ".join(argv) + f" --seed {seed}" * (args.seed is None)
    print(f"soak: {args.backend}, {jobs} jobs over {seconds:g} s, ceiling {max_delay:g} s, "
          f"faults {','.join(args.fault_kinds) or 'none'}, seed {seed}, logs {logs}", flush=True)

    stand = Stand(args.backend, max_delay, kafka_mock_as_is=args.kafka_mock_as_is)
    fleet: Fleet | None = None
    injector: Injector | None = None
    harness: sa.Engine | None = None
    began = time.time()
    load_start = os.getloadavg()[0]
    try:
        stand.open()
        harness = stand.engine()
        app = build_app(None, stand.broker_url, engine=harness)
        fleet = Fleet(stand.proc_database_url, stand.broker_url, logs)
        fleet.start_all()
        sampling = threading.Event()
        sampler = threading.Thread(target=_sample, args=(fleet, sampling), daemon=True)
        sampler.start()
        driver = Driver(app, rng, max_delay)
        driver.add_schedule()
        injector = Injector(args.fault_kinds, fleet, stand, harness, rng,
                            gap, logs / "faults.log")
        injector.skew = args.skew
        injector.start()
        driver.run(seconds, jobs, INTERRUPTED)
        injector.stop()
        driver.pause_schedule()
        load_end = time.time()
        print(f"soak: load done ({driver.scheduled} scheduled, {driver.cancelled} cancelled, "
              f"{driver.rescheduled} rescheduled, {driver.failed_tx} transactions lost to "
              f"faults); draining", flush=True)
        drain_limit = args.drain or (60 if args.minutes is None else 180) + 3 * max_delay
        deadline = time.monotonic() + drain_limit
        while (left := remaining(harness)) and time.monotonic() < deadline:
            time.sleep(0.5)
        drained = time.time() - load_end
        sampling.set()
        fleet.sample_memory()
        died = fleet.died()
        fleet.stop_all()
        verdict = judge(harness, injector.events, fleet)
        verdict.figures["drain after the load"] = (
            f"{drained:.1f} s" + ("" if not left else f" (gave up with {left} unfinished)"))
        verdict.figures["wall time"] = f"{time.time() - began:.0f} s"
        # Other work on the machine shows in every timing figure: say how busy it was.
        verdict.figures["machine load (1-min average, start / end)"] = (
            f"{load_start:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        if "hostile" in args.fault_kinds:
            verdict.figures["hostile messages written into the broker"] = str(
                injector.hostile_sent)
        if died:
            verdict.failures["processes that died on their own"] = died
        if injector.errors:
            verdict.failures["faults that could not be applied"] = injector.errors
        header = [f"### {args.backend}: {jobs} jobs over {seconds:g} s, ceiling {max_delay:g} s",
                  "", f"`{command}`", "",
                  f"Faults: {', '.join(args.fault_kinds) or 'none'}; gap "
                  f"{gap[0]:g}-{gap[1]:g} s; run "
                  f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(began))}."]
        text = render(verdict, header)
        print(text, flush=True)
        if not verdict.ok:
            details = explain(harness, verdict, stand.broker_state())
            (logs / "failures.txt").write_text(details)
            print(f"soak: details of the failures in {logs / 'failures.txt'}", flush=True)
        if args.report:
            with args.report.open("a") as f:
                f.write("\n" + text)
        return 0 if verdict.ok else 1
    except (SoakSetupError, FaultConfigError) as exc:
        print(f"soak: cannot run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"soak: interrupted ({exc}); cleaning up", file=sys.stderr)
        return 130
    finally:
        if injector is not None:
            injector.stop()
        if fleet is not None:
            fleet.stop_all()
        if harness is not None:
            harness.dispose()
        stand.close()


def _sample(fleet: Fleet, done: threading.Event) -> None:
    while not done.wait(1.0):
        fleet.sample_memory()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
