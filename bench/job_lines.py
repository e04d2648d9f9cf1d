"""What the line per finished job costs a worker (issue #33 item 2):
``log_jobs`` off, on with text lines, on with JSON lines, side by side.

    python bench/job_lines.py --lines-only                     # the line alone: CPU per line
    python bench/job_lines.py                                  # and a worker: SQLite, 20,000 jobs
    python bench/job_lines.py --database-url postgresql+psycopg://127.0.0.1/bench --jobs 50000

First the line alone: ``JobLines.write`` called ``--lines`` times for one
job record, off and in each format, and the CPU time per call
(``time.process_time``), the median of ``--rounds``; the figure that says
what a worker at N jobs/s spends on its lines (N times it), whatever else
the machine runs.  Then, unless ``--lines-only``, whole worker runs.  Each
worker trial schedules ``--jobs`` no-op jobs due now (one ``schedule_many``),
then runs one in-process :class:`duebox.Worker` on ``sql://`` (it claims due
rows itself: no relay, no broker) until every job succeeded, and reads the
process's CPU time (``time.process_time``: every thread) and the wall time
over the run.  The lines go to ``/dev/null`` through a ``StreamHandler``
with the command's text format or its JSON formatter, so what is counted is
making and formatting them, not a terminal.  Rounds alternate the three
modes, so the machine's load falls on each alike; the figure to compare is
the CPU per job, which moves less with other load than the rate does.

One JSON line on stdout; a summary on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import sqlalchemy as sa

import duebox
from duebox import migrate
from duebox.observability.logformat import TEXT_FORMAT, JsonFormatter

MODES = ("off", "text", "json")


def _app(url: str, log_jobs: bool) -> duebox.Duebox:
    app = duebox.Duebox(url, "sql://", settings=duebox.Settings(log_jobs=log_jobs))

    @app.task("noop")
    def noop(payload: Any, ctx: duebox.JobContext) -> None:
        return None

    return app


def _clear(app: duebox.Duebox) -> None:
    with app.engine.begin() as conn:
        for table in ("duebox_processed", "duebox_attempt", "duebox_job"):
            conn.execute(sa.text(f"DELETE FROM {table}"))


def _handler(mode: str) -> logging.Handler | None:
    if mode == "off":
        return None
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - closed below
    handler.setFormatter(JsonFormatter() if mode == "json" else logging.Formatter(TEXT_FORMAT))
    return handler


async def _run(app: duebox.Duebox, jobs: int) -> tuple[float, float]:
    """(wall s, CPU s) until every job succeeded."""
    worker = duebox.Worker(app, concurrency=8)
    stop = asyncio.Event()
    wall, cpu = time.monotonic(), time.process_time()
    running = asyncio.create_task(worker.run(stop))
    while worker.stats.succeeded < jobs:
        if running.done():
            running.result()
        await asyncio.sleep(0.01)
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    stop.set()
    await running
    return wall, cpu


def trial(url: str, mode: str, jobs: int) -> dict[str, float]:
    app = _app(url, log_jobs=mode != "off")
    _clear(app)
    with app.engine.begin() as conn:
        app.schedule_many(conn, [app.new_job("noop", {"n": n}) for n in range(jobs)])
    root = logging.getLogger()
    handler = _handler(mode)
    if handler is not None:
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("duebox.worker").setLevel(logging.WARNING)  # its start and stop lines
    try:
        wall, cpu = asyncio.run(_run(app, jobs))
    finally:
        if handler is not None:
            root.removeHandler(handler)
            handler.close()
        app.dispose()
    return {"jobs_s": jobs / wall, "cpu_us": cpu / jobs * 1e6}


def per_line(mode: str, calls: int) -> float:
    """CPU microseconds per ``JobLines.write`` in ``mode``."""
    from datetime import UTC, datetime, timedelta
    from uuid import uuid4

    from duebox.consumers.job_lines import JobLines
    from duebox.leases.records import JobRecord

    due = datetime(2030, 1, 1, tzinfo=UTC)
    rec = JobRecord(id=uuid4(), task="send-reminder", queue="default", payload=None,
                    headers=None, due_at=due, version=1, attempt=1, max_attempts=10,
                    priority=0, tenant=None, key=None, expires_at=None, lease_owner="w#1",
                    lease_generation=1)
    started, finished = due + timedelta(milliseconds=2), due + timedelta(milliseconds=5)
    logger = logging.getLogger("duebox.jobs")
    handler = _handler(mode)
    if handler is not None:
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    lines = JobLines(mode != "off")
    lines.start()
    try:
        cpu = time.process_time()
        for _ in range(calls):
            if lines.enabled:  # as the worker asks
                lines.write(rec, "succeeded", started, finished)
        return (time.process_time() - cpu) / calls * 1e6
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            handler.close()
        logger.propagate = True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--database-url", default=None, help="default: a SQLite file of its own")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lines", type=int, default=100_000, help="calls per mode, line alone")
    p.add_argument("--lines-only", action="store_true", help="the line alone, no worker")
    args = p.parse_args(argv)
    alone = {m: statistics.median(per_line(m, args.lines) for _ in range(args.rounds))
             for m in MODES}
    for mode in MODES:
        print(f"line alone, {mode:>4}: {alone[mode]:6.2f} us CPU per job, "
              f"{alone[mode] * 10_000 / 1e6:.1%} of a core at 10,000 jobs/s", file=sys.stderr)
    if args.lines_only:
        print(json.dumps({"lines": args.lines, "rounds": args.rounds, "nproc": os.cpu_count(),
                          "load": os.getloadavg()[0], "line_us": alone}))
        return
    url = args.database_url or f"sqlite:///{tempfile.mkdtemp()}/bench.db"
    migrate.upgrade(duebox.Duebox(url).engine)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            results[mode].append(trial(url, mode, args.jobs))
            r = results[mode][-1]
            print(f"{mode:>4}: {r['jobs_s']:8,.0f} jobs/s  {r['cpu_us']:6.1f} us CPU/job",
                  file=sys.stderr)
    summary = {m: {k: statistics.median(r[k] for r in results[m]) for k in ("jobs_s", "cpu_us")}
               for m in MODES}
    for mode in MODES[1:]:
        extra = summary[mode]["cpu_us"] - summary["off"]["cpu_us"]
        print(f"{mode}: +{extra:.1f} us CPU per job ({extra / summary['off']['cpu_us']:+.0%}), "
              f"median of {args.rounds}; load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    print(json.dumps({"database": url.split(":")[0], "jobs": args.jobs, "rounds": args.rounds,
                      "nproc": os.cpu_count(), "line_us": alone, "median": summary}))


if __name__ == "__main__":
    main()
