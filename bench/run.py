"""Run duebox's benchmarks and write their sections of bench/RESULTS.md.

    python bench/run.py                          # every backend, 1 trial each (~6 min quiet)
    python bench/run.py --backend sql            # sql:// only, 3 trials per measurement
    python bench/run.py --backend redis,kafka --repeats 3
    python bench/run.py --backend all --quick    # small N: a smoke test of the harness (~3 min)
    python bench/run.py --backend kafka --profile  # + a py-spy profile of the relay
    python bench/run.py --backend sql --only relay,lateness --no-pg

Backends: ``sql`` (the database as the queue: relay to ``memory://``, the
``sql://`` worker, lateness; PostgreSQL and SQLite) and the brokers
``redis``, ``amqp``, ``sqs``, ``kafka`` (relay throughput against a raw
client baseline, lateness with a worker process; see bench/README.md).
Each backend rewrites only its own section of RESULTS.md.

PostgreSQL: ``--pg-url`` (or ``DUEBOX_BENCH_PG``) names a server database to
connect to for CREATE/DROP DATABASE, by default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``.  The run creates
its own ``duebox_bench_<random>`` database and drops it at the end.

Each trial runs in a fresh process (``bench/trials.py``,
``bench/backends_trials.py``) so no pool, cache or thread of one trial leaks
into the next.  Figures are the median of the trials and the range (min-max).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends_report import (
    LABEL,
    Measurement,
    machine_info,
    machine_table,
    med_range,
    verdict,
    write_sections,
)
from backends_run import BROKER_FULL, BROKER_QUICK, cpu_busy, run_backend, run_trial, wait_quiet

HERE = Path(__file__).resolve().parent
TRIALS = HERE / "trials.py"
BACKENDS = ("sql", "redis", "amqp", "sqs", "kafka")
DEFAULT_PG = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

RELAY_TARGET = 10_000.0  # jobs/s on PostgreSQL
LATENESS_TARGET_MS = 20.0  # p99 at 500 jobs/s


@dataclass
class Plan:
    relay_n: dict[str, int]
    worker_n: dict[str, int]
    pipeline_n: dict[str, int]
    rate: float
    seconds: float
    repeats: int
    low_rate: float = 100.0
    low_seconds: float = 5.0


FULL = Plan(
    relay_n={"postgresql": 50_000, "sqlite": 20_000},
    worker_n={"postgresql": 3_000, "sqlite": 3_000},
    pipeline_n={"postgresql": 2_000, "sqlite": 2_000},
    rate=500.0, seconds=10.0, repeats=3,
)
QUICK = Plan(
    relay_n={"postgresql": 5_000, "sqlite": 5_000},
    worker_n={"postgresql": 500, "sqlite": 500},
    pipeline_n={"postgresql": 500, "sqlite": 500},
    rate=500.0, seconds=2.0, repeats=1, low_seconds=2.0,
)


# --- databases -------------------------------------------------------------------


@contextlib.contextmanager
def pg_database(admin_url: str) -> Iterator[str]:
    from sqlalchemy import create_engine, text

    name = f"duebox_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# --- running trials ---------------------------------------------------------------


QUIET_WAIT = 0.0  # set from --wait-quiet


def measure(m: Measurement, repeats: int, make_args: Callable[[int], list[str]],
            timeout: float) -> None:
    for i in range(repeats):
        busy = wait_quiet(QUIET_WAIT) if QUIET_WAIT > 0 else cpu_busy(0.5)
        started = time.monotonic()
        try:
            result = run_trial(TRIALS, make_args(i), timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            m.error = str(exc)
            print(f"  {m.name} [{m.db}] trial {i + 1}: FAILED\n{exc}", flush=True)
            return
        result["background_cpu"] = busy
        result["wall"] = time.monotonic() - started
        m.trials.append(result)
        print(f"  {m.name} [{m.db}] trial {i + 1}/{repeats}: {summary(m.name, result)} "
              f"({result['wall']:.0f}s, CPU busy before, all processes: {busy:.0%})", flush=True)


def summary(name: str, r: dict[str, Any]) -> str:
    if name == "relay":
        return (f"relay {r['relay']['rate']:,.0f} jobs/s, raw {r['raw']['rate']:,.0f} rows/s, "
                f"ratio {r['ratio']:.2f}")
    alone = (f", group commit off {r['alone']['rate']:,.0f} jobs/s" if "alone" in r else "")
    if name == "worker":
        return (f"{r['rate']:,.0f} jobs/s{alone}, raw {r['raw']['rate']:,.0f} jobs/s, "
                f"ratio {r['ratio']:.2f}, CPU {r['cpu_ms_per_job']:.2f} ms/job")
    if name == "pipeline":
        return f"{r['rate']:,.0f} jobs/s{alone}, CPU {r['cpu_ms_per_job']:.2f} ms/job"
    return (f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms, "
            f"early {r['early']}")


# --- the report ------------------------------------------------------------------


DB_LABEL = {"postgresql": "PostgreSQL", "sqlite": "SQLite"}


def sql_section(results: list[Measurement], plan: Plan, command: str,
                machine: list[tuple[str, str]], elapsed: float) -> str:
    """The ``sql`` section of RESULTS.md."""
    out = [f"## {LABEL['sql']}", "",
           f"Generated by `{command}` in {elapsed / 60:.1f} min. "
           f"Each figure is the median of {plan.repeats} trial(s), each in a fresh "
           "process, with the range (min–max) in brackets.  See `bench/README.md` for "
           "what each trial does.", "", "### Machine", "",
           *machine_table([*machine, ("SQLite", sqlite3.sqlite_version)])]
    busy = [t["background_cpu"] for m in results for t in m.trials]
    if busy:
        out += ["", f"CPU busy just before each trial (other processes on the machine): "
                f"median {statistics.median(busy):.0%}, max {max(busy):.0%}."]

    by = {(m.name, m.db): m for m in results}
    out += ["", "### Relay throughput (claim → publish to `memory://` → fenced mark)", "",
            "Batches of 500; N jobs already due; `Relay.run_pass()` until all are ENQUEUED. "
            "Raw = the same claim + mark SQL hand-written on the bare driver (psycopg / "
            "sqlite3), on a freshly reloaded table, in the same process.", "",
            "| database | N | relay jobs/s | raw rows/s | relay ÷ raw | target |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    for db in ("postgresql", "sqlite"):
        m = by.get(("relay", db))
        if m is None:
            continue
        if m.error and not m.trials:
            out.append(f"| {DB_LABEL[db]} | | failed | | | |")
            continue
        relay = [t["relay"]["rate"] for t in m.trials]
        raw = [t["raw"]["rate"] for t in m.trials]
        ratio = [t["ratio"] for t in m.trials]
        target = (f">= {RELAY_TARGET:,.0f}/s: {verdict(statistics.median(relay) >= RELAY_TARGET)}"
                  if db == "postgresql" else "—")
        out.append(f"| {DB_LABEL[db]} | {plan.relay_n[db]:,} | {med_range(relay)} | "
                   f"{med_range(raw)} | {med_range(ratio, '{:.2f}')} | {target} |")

    out += ["", "### Worker throughput (no-op handler, `Worker(app, concurrency=8)`)", "",
            "`sql://`: N due jobs, workers claim rows directly (no relay). "
            "`memory://`: relay + in-process broker + worker in one process. "
            "Jobs/s from start until every job is SUCCEEDED, with the default group commit "
            "(a backlog of short jobs runs up to 32 per transaction, each in its own "
            "savepoint: docs/worker.md) and, in the same trial, with it off "
            "(`group_commit=1`: each job its own transaction with its dedupe row, fenced "
            "completion and attempt row).  Raw = the `sql://` worker's per-job statements "
            "on the bare driver, one transaction per job, freshly reloaded table "
            "(PostgreSQL: 8 threads with a connection each; SQLite: one connection).  CPU "
            "ms/job = process CPU time of the benchmark process ÷ N.", "",
            "| path | database | N | jobs/s | group commit off, jobs/s | raw jobs/s | "
            "worker ÷ raw | CPU ms/job | off: CPU ms/job | raw CPU ms/job |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, label, ns in (("worker", "`sql://` worker", plan.worker_n),
                            ("pipeline", "relay + `memory://` + worker", plan.pipeline_n)):
        for db in ("postgresql", "sqlite"):
            m = by.get((name, db))
            if m is None:
                continue
            if not m.trials:
                out.append(f"| {label} | {DB_LABEL[db]} | {ns[db]:,} | failed | | | | | | |")
                continue
            rates = [t["rate"] for t in m.trials]
            cpu = med_range([t["cpu_ms_per_job"] for t in m.trials], "{:.2f}")
            raw = [t["raw"]["rate"] for t in m.trials if "raw" in t]
            ratio = [t["ratio"] for t in m.trials if "ratio" in t]
            raw_cpu = [t["raw"]["cpu_ms_per_job"] for t in m.trials if "raw" in t]
            alone = [t["alone"]["rate"] for t in m.trials if "alone" in t]
            alone_cpu = [t["alone"]["cpu_ms_per_job"] for t in m.trials if "alone" in t]
            out.append(f"| {label} | {DB_LABEL[db]} | {ns[db]:,} | {med_range(rates)} | "
                       f"{med_range(alone) if alone else '—'} | "
                       f"{med_range(raw) if raw else '—'} | "
                       f"{med_range(ratio, '{:.2f}') if ratio else '—'} | {cpu} | "
                       f"{med_range(alone_cpu, '{:.2f}') if alone_cpu else '—'} | "
                       f"{med_range(raw_cpu, '{:.2f}') if raw_cpu else '—'} |")

    out += ["", "### Lateness on `sql://`", "",
            "A producer process schedules the next 0.1 s worth of jobs every 0.1 s, due 2 s "
            "ahead and evenly spaced; relay + worker (concurrency 8) run in another process. "
            "Lateness = handler start − due_at.  The target applies at "
            f"{plan.rate:.0f} jobs/s; the {plan.low_rate:.0f} jobs/s row shows the floor "
            "when the worker has capacity to spare.", "",
            "| database | offered | jobs | p50 ms | p99 ms | max ms | early | "
            "target p99 <= 20 ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    breakdown = ["", "Where the time went (medians of the trials' percentiles): due → "
                 "`claimed_at` is time spent waiting to be claimed (wake-up, worker "
                 "capacity); `claimed_at` → handler start is the hand-off inside the worker.",
                 "", "| database | offered | due→claim p50 / p99 ms | claim→start p50 / p99 ms |",
                 "| --- | ---: | ---: | ---: |"]
    for name, rate in (("lateness", plan.rate), ("lateness-low", plan.low_rate)):
        for db in ("postgresql", "sqlite"):
            m = by.get((name, db))
            if m is None:
                continue
            if not m.trials:
                out.append(f"| {DB_LABEL[db]} | {rate:.0f}/s | | failed | | | | |")
                continue
            p99 = [t["p99_ms"] for t in m.trials]
            early = sum(t["early"] for t in m.trials)
            ok = (statistics.median(p99) <= LATENESS_TARGET_MS and early == 0
                  if name == "lateness" else None)
            out.append(
                f"| {DB_LABEL[db]} | {rate:.0f}/s | {m.trials[0]['jobs']:,} | "
                f"{med_range([t['p50_ms'] for t in m.trials], '{:.1f}')} | "
                f"{med_range(p99, '{:.1f}')} | "
                f"{med_range([t['max_ms'] for t in m.trials], '{:.1f}')} | {early} | "
                f"{verdict(ok) if ok is not None else '(floor)'} |")

            def med(key: str, trials: list[dict[str, Any]] = m.trials) -> str:
                return f"{statistics.median(t[key] for t in trials):.1f}"

            breakdown.append(
                f"| {DB_LABEL[db]} | {rate:.0f}/s | {med('due_to_claim_p50_ms')} / "
                f"{med('due_to_claim_p99_ms')} | {med('claim_to_start_p50_ms')} / "
                f"{med('claim_to_start_p99_ms')} |")
    if len(breakdown) > 6:
        out += breakdown

    failures = [m for m in results if m.error]
    if failures:
        out += ["", "### Failures", ""]
        for m in failures:
            out += [f"- {m.name} [{m.db}]:", "", "```", m.error or "", "```"]
    out += ["", "<details><summary>raw trial data</summary>", "", "```json"]
    out += [json.dumps({"name": m.name, "db": m.db, "trials": m.trials}) for m in results]
    out += ["```", "", "</details>"]
    return "\n".join(out)


# --- main ------------------------------------------------------------------------


def run_sql(opts: argparse.Namespace, plan: Plan, pg_url: str | None, command: str,
            machine: list[tuple[str, str]]) -> tuple[str, bool]:
    """The sql:// measurements; returns the section and whether any failed."""
    started = time.monotonic()
    only = [x.strip() for x in opts.only.split(",") if x.strip()]
    urls: dict[str, str] = {}
    dbs = [x.strip() for x in opts.db.split(",") if x.strip()]
    results: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="duebox_bench_") as tmp:
        if "postgresql" in dbs and pg_url:
            urls["postgresql"] = pg_url
        if "sqlite" in dbs:
            urls["sqlite"] = f"sqlite:///{tmp}/bench.db"
        for name in only:
            for db, url in urls.items():
                m = Measurement(name, db)
                results.append(m)
                print(f"{name} on {db}:", flush=True)
                if name == "relay":
                    n = plan.relay_n[db]
                    measure(m, plan.repeats, lambda i, url=url, n=n: [
                        "relay", url, str(n), *(["--raw-first"] if i % 2 else [])], 300)
                elif name in ("worker", "pipeline"):
                    n = (plan.worker_n if name == "worker" else plan.pipeline_n)[db]
                    measure(m, plan.repeats,
                            lambda i, name=name, url=url, n=n: [name, url, str(n)], 300)
                elif name in ("lateness", "lateness-low"):
                    rate, secs = ((plan.rate, plan.seconds) if name == "lateness"
                                  else (plan.low_rate, plan.low_seconds))
                    measure(m, plan.repeats, lambda i, url=url, rate=rate, secs=secs: [
                        "lateness", url, str(rate), str(secs)], secs + 120)
                else:
                    raise SystemExit(f"unknown measurement {name!r}")
    section = sql_section(results, plan, command, machine, time.monotonic() - started)
    return section, any(m.error for m in results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="all",
                    help=f"comma-separated subset of {','.join(BACKENDS)}, or all (default)")
    ap.add_argument("--quick", action="store_true", help="small N, 1 trial")
    ap.add_argument("--repeats", type=int,
                    help="trials per measurement (default 3 for one backend, 1 for several)")
    ap.add_argument("--profile", action="store_true",
                    help="broker backends: one more relay trial under py-spy, summarised")
    ap.add_argument("--only", default="relay,worker,pipeline,lateness,lateness-low",
                    help="sql: comma-separated subset of relay,worker,pipeline,lateness,"
                         "lateness-low")
    ap.add_argument("--db", default="postgresql,sqlite", help="sql: postgresql,sqlite")
    ap.add_argument("--no-pg", action="store_true",
                    help="sql: skip PostgreSQL (broker backends always use it)")
    ap.add_argument("--pg-url", default=os.environ.get("DUEBOX_BENCH_PG", DEFAULT_PG))
    ap.add_argument("--output", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each trial, wait up to SECONDS for the machine's CPUs "
                         "to be mostly idle (for shared machines)")
    opts = ap.parse_args()
    # Stopped by a signal (even when started in the background, where SIGINT is
    # ignored), the run still drops its database, vhost, queues and services.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    global QUIET_WAIT
    QUIET_WAIT = opts.wait_quiet
    backends = list(BACKENDS) if opts.backend == "all" else [
        x.strip() for x in opts.backend.split(",") if x.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        ap.error(f"--backend: {', '.join(unknown) or '(none)'} is not one of "
                 f"{', '.join(BACKENDS)} or all")
    repeats = opts.repeats or (3 if len(backends) == 1 else 1)
    if repeats < 1:
        ap.error("--repeats must be at least 1")
    plan = QUICK if opts.quick else FULL
    broker_plan = BROKER_QUICK if opts.quick else BROKER_FULL
    if opts.repeats or not opts.quick:
        plan.repeats = broker_plan.repeats = repeats
    brokers = [b for b in backends if b != "sql"]
    use_pg = bool(brokers) or not opts.no_pg
    command = "python " + " ".join(
        [str(Path(sys.argv[0]).as_posix())] + [shlex.quote(a) for a in sys.argv[1:]])

    started = time.monotonic()
    failed = False
    output = Path(opts.output)
    with contextlib.ExitStack() as stack:
        pg_url = stack.enter_context(pg_database(opts.pg_url)) if use_pg else None
        machine = machine_info(pg_url)
        for key, value in machine:
            print(f"{key}: {value}")
        if "sql" in backends:
            section, bad = run_sql(opts, plan, None if opts.no_pg else pg_url, command, machine)
            write_sections(output, {"sql": section})  # written as soon as measured
            failed |= bad
        for backend in brokers:
            assert pg_url is not None
            section = run_backend(backend, pg_url, broker_plan, machine, command,
                                  quiet=opts.wait_quiet, profile=opts.profile)
            write_sections(output, {backend: section})
            failed |= "failed" in section.split("<details>")[0]
    elapsed = time.monotonic() - started
    print(f"\nwrote {', '.join(backends)} to {output} ({elapsed / 60:.1f} min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
