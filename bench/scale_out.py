"""Scale-out (issue #35): 1, 2 and 4 sharded relays against 1, 2 and 4
worker processes, on PostgreSQL with Redis and with RabbitMQ, through the
real ``duebox relay`` and ``duebox worker`` commands.

    python bench/scale_out.py                      # the whole matrix, ~12 min on 2 cores
    python bench/scale_out.py --backends redis --relays 1,4 --processes 2 --jobs 5000
    python bench/scale_out.py --report-only        # RESULTS section from scale_out.json
    python bench/scale_out.py --json bench/scale_out-2.json \
        --report bench/scale_out.json,bench/scale_out-2.json   # a second run beside the first

One combination, in fresh resources (its own database and Redis prefix or
RabbitMQ vhost, bench/peers/resources.py): start R ``duebox relay``
processes with ``DUEBOX_SHARDS=--shards`` and one ``duebox worker
--processes P`` (``DUEBOX_PROCESSES``), wait until a warm-up job has run and
every relay holds its share of the shards (``duebox_lease``), then insert
``--jobs`` no-op jobs **already due** in one transaction (bench/burst9.py's
insert, due a second before it starts).  Due at the commit, none can be
handed to the broker ahead with its delay, so every job goes through a
relay's claim, its publish and a worker while the clock runs: the relays
are on the measured path, as they are not in the 9 am burst's pre-staged
drain.  ``DUEBOX_CATCHUP_AFTER=3600``: a drain slowed by the machine's load
is not outage backlog, to be released at ``catchup_rate``.

Reported: jobs/s from the first start to the last; lateness (start −
commit: the jobs were due by then) p50/p99; CPU ms per job of the relays,
the worker (its supervisor and children), PostgreSQL (this database's
backends and the shared writers) and the broker, from /proc, from the start
of the insert to the last start (bench/peers/cpu.py; the inserting
process's own backend is not counted, it is gone by then), and the cores they
used together over that time; PostgreSQL's transactions and row writes per
job (``pg_stat_database`` of the run's own database); the connections each
relay and worker process held to PostgreSQL and to the broker at the end of
the drain (bench/peers/connections.py); the load average at the start and
end.  The combinations run in order of (relays, processes), both backends
of one before the next, so the machine's load falls on both alike.

Writes bench/scale_out.json (``--json``) and the ``scale-out`` section of
bench/RESULTS.md: a table per run of ``--report`` (default: this one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import backends_report  # noqa: E402  (bench/, this script's folder)
import connections  # noqa: E402  (bench/peers, put on the path above)
import machine  # noqa: E402
import record  # noqa: E402
from burst9 import BACKENDS, _fmt, _insert  # noqa: E402
from cpu import CpuMeter  # noqa: E402
from report import pct  # noqa: E402
from resources import environment  # noqa: E402
from systems import SYSTEMS, System  # noqa: E402
from workloads import Context, Processes, WorkloadError, _env, _run, _wait  # noqa: E402

OUT = HERE / "scale_out.json"
RESULTS = HERE / "RESULTS.md"
SECTION = "scale-out"
PORTS = {"pg": 5432, "redis": 6379, "amqp": 5672}
_STATS = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted",
          "tup_fetched")


def _db_stats(pg_url: str) -> dict[str, int]:
    """This database's cumulative counters (PostgreSQL reports a backend's
    at the end of its transactions, at most a second late)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        row = conn.execute(f"SELECT {', '.join(_STATS)} FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    assert row is not None
    return dict(zip(_STATS, (int(x) for x in row), strict=True))


def _shards_held(pg_url: str, shards: int) -> list[int]:
    """How many live shard leases each relay holds, most first."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM duebox_lease WHERE name LIKE %s AND owner IS NOT NULL "
            "AND expires_at > now() GROUP BY owner ORDER BY 1 DESC",
            (f"shard:%/{shards}",)).fetchall()
    return [int(r[0]) for r in rows]


def _balanced(pg_url: str, relays: int, shards: int, procs: Processes,
              timeout: float = 90.0) -> list[int]:
    """Wait until every shard has an owner and min(relays, shards) relays
    hold them, none more than its share: the relays rebalance once a pass
    (relay/shards.py), so this takes a few of their poll intervals."""
    share = -(-shards // relays)
    deadline = time.monotonic() + timeout
    while True:
        held = _shards_held(pg_url, shards)
        if sum(held) == shards and len(held) == min(relays, shards) and held[0] <= share:
            return held
        procs.check()
        if time.monotonic() > deadline:
            raise WorkloadError(f"shards not balanced over {relays} relays in {timeout:.0f} s:"
                                f" held {held}")
        time.sleep(0.2)  # polling a table other processes write: no event to wait on


def _kind(name: str) -> str:
    """``relay2`` → ``relay``: the meter's and the sockets' names are per process."""
    return name.rstrip("0123456789")


def _by_kind(per_name: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, v in per_name.items():
        out[_kind(name)] = out.get(_kind(name), 0.0) + v
    return out


def combination(base: System, ctx: Context, relays: int, processes: int, shards: int,
                n: int) -> dict[str, Any]:
    # The jobs are due before the insert: a slow drain under load must not
    # turn its tail into outage backlog, released at catchup_rate (100/s).
    system = replace(base, processes=("relay",) * relays + ("worker",),
                     env=(("DUEBOX_SHARDS", str(shards)), ("DUEBOX_PROCESSES", str(processes)),
                          ("DUEBOX_CATCHUP_AFTER", "3600")))
    rec = tempfile.mkdtemp(prefix="bench-scale-rec-")
    load = [os.getloadavg()[0]]
    try:
        with environment(system, ctx.kafka, ctx.sqs, rec) as base_env:
            env = _env(system, base_env, aggressive=False)
            pg_url = env["BENCH_PG_URL"]
            _run(system, env, "setup")
            procs = Processes(system, env, ctx, f"scale-{system.name}-{relays}r{processes}p")
            try:
                _run(system, env, "enqueue", "--warmup")
                _wait(rec, 1, procs, timeout=120)
                held = _balanced(pg_url, relays, shards, procs)
                names = {f"{name}{i}": p.pid for i, (name, p) in enumerate(procs.procs)}
                meter = CpuMeter(system.broker, pg_url, names)
                before = _db_stats(pg_url)
                # From before the insert: the relays claim from its commit on,
                # before the inserting process has even exited.
                meter.start()
                ins = _insert(env, n, 1, lead=-1.0)  # due before the insert: nothing ahead
                _wait(rec, n + 1, procs, timeout=900)
                meter.stop()
                conns = {server: connections.by_group(names, PORTS[server])
                         for server in ("pg", system.broker)}
            finally:
                procs.stop()
            after = _db_stats(pg_url)  # the stopped processes' backends reported theirs
        starts = sorted(s for _, d, s in record.read_tagged(rec) if d > 0)
    finally:
        shutil.rmtree(rec, ignore_errors=True)
    load.append(os.getloadavg()[0])
    late = [(s - ins["inserted_at"]) * 1000 for s in starts]
    drain_s = starts[-1] - ins["inserted_at"]
    cpu = meter.per_job(n)
    cpu_s = {**_by_kind(meter.by_process_s), "database": meter.database_s,
             "broker": meter.broker_s}
    return {
        "relays": relays, "processes": processes, "shards": shards, "held": held,
        "jobs": len(starts), "insert_s": ins["insert_s"],
        "rate": (len(starts) - 1) / (starts[-1] - starts[0]),
        "p50_ms": pct(late, 50), "p99_ms": pct(late, 99), "drain_s": drain_s,
        "cpu_ms": {**{k: v * 1000 / n for k, v in cpu_s.items()}, "total": cpu["total_ms"]},
        "cores": sum(cpu_s.values()) / (drain_s + ins["insert_s"]),
        "db_per_job": {k: (after[k] - before[k]) / n for k in _STATS},
        "connections": {server: _by_kind({k: float(v) for k, v in c.items()})
                        for server, c in conns.items()},
        "load": load,
    }


# --- the report --------------------------------------------------------------------


def _per_process(r: dict[str, Any], server: str) -> str:
    """Connections to ``server`` per relay process / per worker process."""
    c = r["connections"].get(server, {})
    return f"{c.get('relay', 0) / r['relays']:.0f} / {c.get('worker', 0) / r['processes']:.1f}"


def _run_table(data: dict[str, Any], path: str) -> list[str]:
    """One run: what, when, where and at what load; then its rows."""
    m = data["machine"]
    lines = [
        f"### {data['started'][:16].replace('T', ' ')}–{data.get('finished', '?')[11:16]} UTC,"
        f" load {' / '.join(f'{x:.1f}' for x in data['load_start'])} at the start",
        "",
        f"`{data['command']}` (git {data['git']}; {m['nproc']} CPUs, {m['cpu']}, "
        f"{m['ram_gib']} GiB; PostgreSQL {m['servers'].get('PostgreSQL')}, Redis "
        f"{m['servers'].get('Redis')}, RabbitMQ {m['servers'].get('RabbitMQ')}): "
        f"{data['jobs']:,} jobs a row, `DUEBOX_SHARDS={data['shards']}`; load average at the "
        f"end {' / '.join(f'{x:.1f}' for x in data.get('load_end', []))}.  Raw figures: "
        f"`{path}`.",
        "",
        "| backend | relays | worker processes | jobs/s | p50 ms | p99 ms "
        "| CPU ms/job relay / worker / db / broker = total | cores | db xact/job "
        "| rows updated/job | PG conns / relay, / worker proc | broker conns / relay, "
        "/ worker proc | load |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- "
        "| --- |",
    ]
    for key, r in data["results"].items():
        backend = key.split(":", 1)[0]
        if "error" in r:
            lines.append(f"| {backend} | {r.get('relays', '')} | {r.get('processes', '')} "
                         f"| error: {r['error'][:200]} | | | | | | | | | |")
            continue
        c, db = r["cpu_ms"], r["db_per_job"]
        lines.append(
            f"| {backend} | {r['relays']} | {r['processes']} | {_fmt(r['rate'], 0)} "
            f"| {_fmt(r['p50_ms'], 0)} | {_fmt(r['p99_ms'], 0)} "
            f"| {c.get('relay', 0):.3f} / {c.get('worker', 0):.3f} / {c['database']:.3f} / "
            f"{c['broker']:.3f} = {c['total']:.3f} | {r['cores']:.2f} "
            f"| {db['xact_commit'] + db['xact_rollback']:.3f} | {db['tup_updated']:.2f} "
            f"| {_per_process(r, 'pg')} | {_per_process(r, backend)} "
            f"| {r['load'][0]:.1f} → {r['load'][1]:.1f} |")
    return lines


def section(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The section: what a row measures, then a table per run (path, data)."""
    lines = [
        "## Scale-out: sharded relays × worker processes (issue #35)",
        "",
        "Written by `bench/scale_out.py`.  Per row: no-op jobs, all already due, inserted "
        "in one transaction while R `duebox relay` processes (sharded, the shards balanced "
        "before the insert; `DUEBOX_CATCHUP_AFTER=3600`) and one `duebox worker --processes "
        "P` (concurrency 8 per process) run; every job goes through a relay's claim and "
        "publish.  jobs/s: first start to last.  Lateness: start − commit.  CPU ms/job from "
        "/proc, start of the insert to last start (not the insert's own backend): relays "
        "(all) / worker (supervisor and children) / PostgreSQL (this database's backends "
        "and the shared writers) / broker (the whole server: shared with the machine's "
        "other users, an upper bound); *cores*: their CPU seconds over that time.  "
        "PostgreSQL per job: transactions (commits + rollbacks) and rows updated, from the "
        "database's `pg_stat_database`.  Connections held at the end of the drain, per "
        "relay process / per worker process.  *load*: 1-minute load average at the row's "
        "start → end.  The machine was shared: under load, jobs/s is a floor of what it "
        "does quiet and lateness an upper bound (CPU per job holds better).  What the "
        "figures mean for a 10× and a 100× deployment: docs/scale.md, \"Scale-out "
        "figures\".",
    ]
    for path, data in runs:
        lines += ["", *_run_table(data, path)]
    return "\n".join(lines)


def _counts(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: a comma-separated list of whole numbers (got {text!r})"
                         ) from None
    if not out or min(out) < 1:
        raise SystemExit(f"--{what}: each count must be 1 or more (got {text!r})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="redis,amqp",
                        help="comma-separated: redis, amqp (sql:// workers are not sharded)")
    parser.add_argument("--relays", default="1,2,4")
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--shards", type=int, default=4,
                        help="DUEBOX_SHARDS of every relay (at least the most relays)")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--json", default=str(OUT.relative_to(HERE.parent)),
                        help="where this run's figures go")
    parser.add_argument("--report", default=None,
                        help="comma-separated JSON files of the runs the section shows, "
                             "in order (default: --json's)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the section from --report (or --json), run nothing")
    args = parser.parse_args()
    shown = [p.strip() for p in (args.report or args.json).split(",") if p.strip()]
    if args.report_only:
        write_report(shown)
        return
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not names or any(b not in ("redis", "amqp") for b in names):
        raise SystemExit(f"--backends: redis and/or amqp (got {args.backends!r}; sql:// "
                         "workers claim rows themselves and are not sharded)")
    relays, processes = _counts(args.relays, "relays"), _counts(args.processes, "processes")
    if args.shards < max(relays):
        raise SystemExit(f"--shards: at least the most relays, {max(relays)} (got "
                         f"{args.shards}): a relay with no shard would only idle")
    if args.jobs < 1:
        raise SystemExit("--jobs: 1 or more")
    by_name = {s.name: s for s in SYSTEMS}
    data: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python bench/scale_out.py " + " ".join(sys.argv[1:]),
        "jobs": args.jobs, "shards": args.shards, "machine": machine.describe(),
        "load_start": os.getloadavg(), "results": {},
        "git": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE,
                              capture_output=True, text=True).stdout.strip()}
    logs = Path(tempfile.mkdtemp(prefix="bench-scale-logs-"))
    ctx = Context(kafka=None, sqs=None, logs=logs)
    for r in relays:
        for p in processes:
            for b in names:
                t = time.monotonic()
                try:
                    res = combination(by_name[BACKENDS[b]], ctx, r, p, args.shards, args.jobs)
                except Exception as exc:  # a failed combination is reported, not dropped
                    res = {"relays": r, "processes": p,
                           "error": f"{type(exc).__name__}: {exc}"[:2000]}
                res["wall_s"] = time.monotonic() - t
                data["results"][f"{b}:{r}r{p}p"] = res
                print(f"{b} {r} relays {p} processes: " + json.dumps(res), file=sys.stderr,
                      flush=True)
    data["load_end"] = os.getloadavg()
    data["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    (HERE.parent / args.json).write_text(json.dumps(data, indent=1) + "\n")
    write_report(shown)
    print(f"logs in {logs}; wrote {args.json} and the {SECTION} section of {RESULTS}",
          file=sys.stderr)


def write_report(paths: list[str]) -> None:
    """The section from these runs' JSON files (relative to the repository)."""
    runs = [(p, json.loads((HERE.parent / p).read_text())) for p in paths]
    backends_report.write_sections(RESULTS, {SECTION: section(runs)})


if __name__ == "__main__":
    main()
