"""The 9 am burst (issue #20): 100,000 jobs due in the same second across 10
tenants, on each backend, with the real ``duebox relay`` and ``duebox
worker`` processes at their defaults (the worker runs one process per CPU).

    python bench/burst9.py                          # sql, redis, amqp; ~6 min
    python bench/burst9.py --backends sql --jobs 20000
    python bench/burst9.py --policy '{"fair": true}'   # fair shares on
    python bench/burst9.py --report-only            # RESULTS section from burst9.json

What a run does, per backend, in fresh resources (its own database, Redis
prefix or RabbitMQ vhost; bench/peers/resources.py): start the relay and
the worker, wait until a warm-up job has run, then insert ``--jobs`` jobs
all due at T = (insert start + ``--lead`` s), whole second, in one
transaction (``schedule_many``, 1,000 a call).  Tenants own contiguous
blocks of 10,000 ids: tenant ``t0`` was scheduled first, ``t9`` last, the
order in which a plain due-time claim serves them, so due-order shows its
unfairness and ``--policy`` its remedy.  On broker backends the relay
publishes the jobs ahead with the broker's delay during the lead.

Reported: seconds from T until every job has started, jobs/s over that
time, lateness (start - due) p50/p99/max, early starts (must be 0),
fairness (each tenant's last start after T and its p50 lateness: min and
max over tenants, and the ratio of the slowest tenant's to the fastest's),
and CPU ms per job from /proc for relay, worker, PostgreSQL and the broker
together (bench/peers/cpu.py), counted from the end of the insert to the
last start.

Writes bench/burst9.json (every figure and the raw per-tenant data) and the
``burst9`` section of bench/RESULTS.md.
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import machine  # noqa: E402  (bench/peers, put on the path above)
import record  # noqa: E402
from cpu import CpuMeter  # noqa: E402
from report import pct  # noqa: E402
from resources import environment  # noqa: E402
from systems import SYSTEMS, System  # noqa: E402
from workloads import Context, Processes, WorkloadError, _env, _run, _wait  # noqa: E402

OUT = HERE / "burst9.json"
RESULTS = HERE / "RESULTS.md"
BACKENDS = {"sql": "duebox-sql", "redis": "duebox-redis", "amqp": "duebox-amqp"}


def _insert(env: dict[str, str], n: int, tenants: int, lead: float) -> dict[str, float]:
    """Insert the burst in a child process with the workload's environment
    (DUEBOX_DATABASE_URL...), so nothing of it runs in the measured processes."""
    code = f"""
import json, math, sys, time
from datetime import UTC, datetime
sys.argv = ["x"]
import peer_duebox
app = peer_duebox.app
t0 = time.time()
due = math.ceil(t0 + {lead})        # a whole second, like 09:00:00
at = datetime.fromtimestamp(due, UTC)
n, k = {n}, {tenants}
block = math.ceil(n / k)
with app.engine.begin() as conn:
    for i in range(0, n, 1000):
        app.schedule_many(conn, [app.new_job("noop", {{"due": due}}, at=at,
                                             tenant=f"t{{j // block}}")
                                 for j in range(i, min(n, i + 1000))])
print(json.dumps({{"due": due, "insert_s": time.time() - t0, "inserted_at": time.time()}}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE / "peers", env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise WorkloadError(f"insert failed: {done.stderr[-1500:]}")
    out: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def burst(system: System, ctx: Context, n: int, tenants: int, lead: float,
          policy: str | None) -> dict[str, Any]:
    rec = tempfile.mkdtemp(prefix="bench-burst9-rec-")
    try:
        with environment(system, ctx.kafka, ctx.sqs, rec) as base:
            env = _env(system, base, aggressive=False)
            if policy:
                env["DUEBOX_DISPATCH_POLICY"] = policy
            _run(system, env, "setup")
            procs = Processes(system, env, ctx, f"burst9-{system.name}")
            try:
                _run(system, env, "enqueue", "--warmup")
                _wait(rec, 1, procs, timeout=120)
                meter = CpuMeter(system.broker, env["BENCH_PG_URL"],
                                 {name: p.pid for name, p in procs.procs})
                ins = _insert(env, n, tenants, lead)
                if ins["inserted_at"] >= ins["due"]:
                    raise WorkloadError(f"the insert took {ins['insert_s']:.1f} s, past the "
                                        f"due time: raise --lead")
                meter.start()
                _wait(rec, n + 1, procs, timeout=lead + 900)
                meter.stop()
            finally:
                procs.stop()
        rows = [(t, d, s) for t, d, s in record.read_tagged(rec) if d > 0]
    finally:
        shutil.rmtree(rec, ignore_errors=True)
    return summarise(rows, ins, meter.per_job(n), n)


def summarise(rows: list[tuple[str, float, float]], ins: dict[str, float],
              cpu: dict[str, float], n: int) -> dict[str, Any]:
    due = ins["due"]
    late = sorted((s - d) * 1000 for _, d, s in rows)
    last = max(s for _, _, s in rows) - due
    by_tenant: dict[str, list[float]] = {}
    for t, d, s in rows:
        by_tenant.setdefault(t, []).append(s - d)
    tenants = {t: {"jobs": len(v), "done_s": max(v), "p50_ms": pct(sorted(v), 50) * 1000}
               for t, v in sorted(by_tenant.items(), key=lambda kv: int(kv[0][1:] or 0))}
    done = [v["done_s"] for v in tenants.values()]
    p50s = [v["p50_ms"] for v in tenants.values()]
    return {"jobs": len(rows), "expected": n, "insert_s": ins["insert_s"],
            "lead_s": due - ins["inserted_at"] + ins["insert_s"],
            "all_started_s": last, "rate": len(rows) / last if last > 0 else None,
            "p50_ms": pct(late, 50), "p99_ms": pct(late, 99), "max_ms": late[-1],
            "early": sum(1 for x in late if x < 0), "min_ms": late[0],
            "tenant_done_s": [min(done), max(done)], "tenant_p50_ms": [min(p50s), max(p50s)],
            "tenant_p50_ratio": max(p50s) / min(p50s) if min(p50s) > 0 else None,
            "tenants": tenants, "cpu": cpu}


def _fmt(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def section(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "<!-- section: burst9 -->",
        "## The 9 am burst",
        "",
        f"Generated by `{data['command']}` on {data['started'][:16].replace('T', ' ')} UTC "
        f"(git {data['git']}; {m['nproc']} CPUs, {m['cpu']}; "
        f"load average at start {' / '.join(f'{x:.2f}' for x in data['load_start'])}).",
        "",
        f"{data['jobs']:,} no-op jobs all due in the same whole second T, across "
        f"{data['tenants']} tenants in contiguous blocks (tenant t0 scheduled first, t9 last), "
        "inserted in one transaction while `duebox relay` and `duebox worker` (defaults: one "
        "worker process per CPU, concurrency 8 each) already run; on Redis and RabbitMQ the "
        "relay publishes them ahead with the broker's delay.  Lateness = handler start − T. "
        "Fairness: each tenant's last start after T and its p50 lateness, min–max over "
        "tenants.  CPU ms/job: relay + worker + PostgreSQL + broker from /proc, from the end "
        "of the insert to the last start (bench/peers/cpu.py).  "
        f"Dispatch policy: {data['policy'] or 'the default (due order)'}.",
        "",
        "| backend | all started after T, s | jobs/s | p50 ms | p99 ms | max ms | early "
        "| tenants done, s (first–last) | tenants p50 ms (min–max) | CPU ms/job "
        "(relay / worker / db / broker = total) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for name, r in data["results"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]} | | | | | | | | |")
            continue
        c = r["cpu"]
        lines.append(
            f"| {name} | {_fmt(r['all_started_s'], 2)} | {_fmt(r['rate'], 0)} "
            f"| {_fmt(r['p50_ms'])} | {_fmt(r['p99_ms'])} | {_fmt(r['max_ms'])} | {r['early']} "
            f"| {r['tenant_done_s'][0]:.2f}–{r['tenant_done_s'][1]:.2f} "
            f"| {_fmt(r['tenant_p50_ms'][0], 0)}–{_fmt(r['tenant_p50_ms'][1], 0)} "
            f"| {c.get('relay_ms', 0):.2f} / {c.get('worker_ms', 0):.2f} / "
            f"{c['database_ms']:.2f} / {c['broker_ms']:.2f} = {c['total_ms']:.2f} |")
    lines += ["", "Raw figures, per tenant: `bench/burst9.json`.", "<!-- /section: burst9 -->"]
    return "\n".join(lines)


def write_section(text: str) -> None:
    md = RESULTS.read_text()
    start, end = "<!-- section: burst9 -->", "<!-- /section: burst9 -->"
    if start in md:
        before, rest = md.split(start, 1)
        md = before + text + rest.split(end, 1)[1]
    else:
        md = md.rstrip("\n") + "\n\n" + text + "\n"
    RESULTS.write_text(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="sql,redis,amqp",
                        help="comma-separated: " + ", ".join(BACKENDS))
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--lead", type=float, default=20.0,
                        help="seconds from the insert's start to T (the insert must end first)")
    parser.add_argument("--policy", default=None,
                        help="DUEBOX_DISPATCH_POLICY for relay and worker (JSON)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.report_only:
        write_section(section(json.loads(OUT.read_text())))
        return
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or args.jobs < args.tenants or args.tenants < 1:
        raise SystemExit(f"--backends: unknown {unknown}; known: {', '.join(BACKENDS)}"
                         if unknown else "--jobs must be >= --tenants >= 1")
    by_name = {s.name: s for s in SYSTEMS}
    data: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python bench/burst9.py " + " ".join(sys.argv[1:]),
        "jobs": args.jobs, "tenants": args.tenants, "lead": args.lead, "policy": args.policy,
        "machine": machine.describe(), "load_start": os.getloadavg(), "results": {},
        "git": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE,
                              capture_output=True, text=True).stdout.strip()}
    logs = Path(tempfile.mkdtemp(prefix="bench-burst9-logs-"))
    ctx = Context(kafka=None, sqs=None, logs=logs)
    for b in names:
        t = time.monotonic()
        try:
            res = burst(by_name[BACKENDS[b]], ctx, args.jobs, args.tenants, args.lead,
                        args.policy)
        except Exception as exc:  # a failed backend is reported, not dropped
            res = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        res["wall_s"] = time.monotonic() - t
        data["results"][b] = res
        print(f"{b}: " + json.dumps({k: v for k, v in res.items()
                                     if k not in ("tenants", "cpu")}), file=sys.stderr,
              flush=True)
    data["load_end"] = os.getloadavg()
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    write_section(section(data))
    print(f"logs in {logs}; wrote {OUT} and the burst9 section of {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
