"""RabbitMQ's two delay modes side by side, from one run: the
``rabbitmq_delayed_message_exchange`` plugin and the TTL tier topology.

    python bench/amqp_delays.py [--repeats 1] [--n 100000] [--seconds 10] [--restart]

For each mode (``delay_mode=plugin``, then ``tiers``), each trial in a fresh
process (``bench/backends_trials.py``) and a vhost of its own:

- **relay**: N jobs due log-uniformly from 1 hour to 30 days (the ``amqp``
  relay trial with ``--min-delay 3600``), every one published through the
  broker's delay: claim, publish with the broker's confirm, fenced mark;
  batches of 500.
- **pending**: right after it, the messages waiting out a delay (the
  plugin's Mnesia table for the run's exchange, or the tier queues) and the
  node's memory (``erlang:memory(total)``, ``rabbitmq-diagnostics
  memory_breakdown``) against just before the trial.  The broker is shared:
  other sessions move these too.
- **restart** (``--restart``): ``rabbitmqctl stop_app`` / ``start_app`` with
  them pending; how long each step takes, how many are pending afterwards.
  Everyone using the broker sees it go away for that long.
- **lateness** at 100 and 500 jobs/s for ``--seconds``, jobs due 2 s ahead:
  the relay's default (jobs due within 15 s are published 30 ms before due
  with no delay: the same path in both modes) and ``near_window=0`` (every
  job through the broker's delay).

The plugin keeps a deleted vhost's delayed messages until their delay ends
(up to 30 days here), so each plugin trial deletes its own from the plugin's
table at the end.  Writes the ``amqp-delays`` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import backends_report
import backends_services
from backends_report import Measurement, med_range
from backends_run import _trial
from run import DEFAULT_PG, pg_database

HERE = Path(__file__).resolve().parent
MODES = ("plugin", "tiers")
RATES = (100.0, 500.0)
MIN_DELAY = 3600.0  # relay trial: every message still waits when memory is read
# The breakdown categories a delayed message can land in.
CATEGORIES = ("mnesia", "binary", "queue_procs", "msg_index", "other_ets", "other_proc")


def rabbitmqctl(*args: str) -> str:
    return str(backends_services.test_backends().rabbitmqctl(*args, timeout=300))


def node_memory() -> dict[str, int]:
    out = subprocess.run(["rabbitmq-diagnostics", "-q", "memory_breakdown", "--unit", "bytes",
                          "--formatter", "json"], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    breakdown = json.loads(out)
    mem = {k: int(breakdown[k]["bytes"]) for k in CATEGORIES if k in breakdown}
    mem["total"] = int(rabbitmqctl("eval", "erlang:memory(total).").strip())
    return mem


def pending(url: str, mode: str, *, delete: bool = False) -> int:
    vhost = unquote(urlsplit(url).path.lstrip("/"))
    if mode == "plugin":
        return int(backends_services.test_backends().plugin_delayed(
            vhost, "bench.delayed", delete=delete))
    return sum(n for name, n, _ in backends_services.amqp_queues(url) if ".delay." in name)


def vhost_ready(url: str, limit: float = 120.0) -> None:
    """After ``start_app`` the node answers before every vhost is back up
    (a ``delete_vhost`` then fails): wait until this one lists its queues."""
    deadline = time.monotonic() + limit
    while True:
        try:
            backends_services.amqp_queues(url)
            return
        except subprocess.CalledProcessError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def timed(*args: str) -> float:
    t = time.monotonic()
    rabbitmqctl(*args)
    return time.monotonic() - t


def relay_trial(m: Measurement, mode: str, db_url: str, n: int, restart: bool,
                quiet: float) -> None:
    with backends_services.amqp_url(mode) as url:
        before = node_memory()
        r = _trial(m, ["relay", "amqp", db_url, url, str(n), "--min-delay", str(MIN_DELAY)],
                   quiet, 900)
        if r is None:
            return
        try:
            r["pending"] = pending(url, mode)
            after = node_memory()
            r["memory"] = {k: after[k] - before.get(k, 0) for k in after}
            r["memory_after"] = after
            if restart:
                try:
                    stop = timed("stop_app")
                finally:
                    start = timed("start_app") + timed("await_startup")
                vhost_ready(url)
                r["restart"] = {"stop_s": stop, "start_s": start,
                                "pending_after": pending(url, mode)}
        finally:
            if mode == "plugin":
                r["deleted"] = pending(url, mode, delete=True)
        m.trials.append(r)
        print(f"  relay [{mode}]: {r['relay']['rate']:,.0f} jobs/s, {r['pending']:,} pending, "
              f"node memory {r['memory']['total'] / 2**20:+,.1f} MiB"
              + (f", restart {r['restart']}" if restart else ""), flush=True)


def lateness_trial(m: Measurement, mode: str, db_url: str, rate: float, seconds: float,
                   near: float | None, quiet: float) -> None:
    with backends_services.amqp_url(mode) as url:
        args = ["lateness", "amqp", db_url, url, str(rate), str(seconds)]
        r = _trial(m, args + ([str(near)] if near is not None else []), quiet, seconds + 300)
    if r is not None:
        m.trials.append(r)
        print(f"  {m.name} [{mode}]: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
              f"max {r['max_ms']:.1f} ms, early {r['early']}", flush=True)


def mib(values: list[float]) -> str:
    return med_range([v / 2**20 for v in values], "{:,.1f}") + " MiB"


def section(relay: dict[str, Measurement], late: dict[tuple[str, str, float], Measurement],
            header: list[str], restart: bool) -> str:
    def vals(m: Measurement, *path: str) -> list[float]:
        out = []
        for t in m.trials:
            v: Any = t
            for p in path:
                v = v[p]
            out.append(float(v))
        return out

    cols = " | ".join(MODES)
    lines = ["## amqp://: the delayed-message plugin and the TTL tiers side by side", "",
             *header, "",
             "**Relay throughput and what pending delays cost** — the `amqp` relay trial "
             "(bench/backends_trials.py): jobs due log-uniformly from 1 hour to 30 days, "
             "all through the broker's delay; then the messages still waiting out their delay and "
             "the change in the RabbitMQ node's memory since just before the trial "
             "(`erlang:memory(total)` and `rabbitmq-diagnostics memory_breakdown`; the node is "
             "shared, so other sessions' use is in the difference too).", "",
             f"| measurement | {cols} |", f"| --- | {' | '.join('---:' for _ in MODES)} |"]
    rows: list[tuple[str, list[str]]] = [
        ("jobs published", [med_range(vals(relay[x], "n")) for x in MODES]),
        ("relay (jobs/s)", [med_range(vals(relay[x], "relay", "rate")) for x in MODES]),
        ("relay CPU per job (ms)", [med_range(vals(relay[x], "relay", "cpu_ms_per_job"),
                                              "{:.3f}") for x in MODES]),
        ("raw pika, same server, no delay (msg/s)", [med_range(vals(relay[x], "raw", "rate"))
                                                     for x in MODES]),
        ("still waiting out a delay afterwards", [med_range(vals(relay[x], "pending"))
                                                  for x in MODES]),
        ("node memory, change", [mib(vals(relay[x], "memory", "total")) for x in MODES]),
    ]
    for cat in CATEGORIES:
        rows.append((f"… of which `{cat}`", [mib(vals(relay[x], "memory", cat)) for x in MODES]))
    if restart:
        rows += [
            ("`stop_app` with them pending (s)", [med_range(vals(relay[x], "restart", "stop_s"),
                                                            "{:.1f}") for x in MODES]),
            ("`start_app` + `await_startup` (s)", [
                med_range(vals(relay[x], "restart", "start_s"), "{:.1f}") for x in MODES]),
            ("still waiting after the restart", [
                med_range(vals(relay[x], "restart", "pending_after")) for x in MODES]),
        ]
    lines += [f"| {name} | {' | '.join(v)} |" for name, v in rows]
    lines += ["", "**Lateness** — a producer process schedules jobs due 2 s ahead, evenly "
              "spaced, at the rate for the duration; relay in one process, "
              "`Worker(concurrency=8)` in another; lateness = the handler's start − `due_at`. "
              "*Default relay*: jobs due within 15 s are held by the relay and published 30 ms "
              "before due with no delay (the same path in both modes).  *Through the broker's "
              "delay*: `Relay(near_window=0)`, every job waits out its 2 s in the plugin or the "
              "tiers.", "",
              "| relay | rate | mode | p50 ms | p99 ms | max ms | early | worker CPU ms/job |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (path, mode, rate), m in late.items():
        label = "default" if path == "default" else "through the broker's delay"
        if m.error and not m.trials:
            lines.append(f"| {label} | {rate:g}/s | {mode} | failed: {m.error.splitlines()[0]} "
                         "| | | | |")
            continue
        lines.append(
            f"| {label} | {rate:g}/s | {mode} | {med_range(vals(m, 'p50_ms'), '{:.1f}')} | "
            f"{med_range(vals(m, 'p99_ms'), '{:.1f}')} | {med_range(vals(m, 'max_ms'), '{:.1f}')} "
            f"| {int(sum(vals(m, 'early')))} | "
            f"{med_range(vals(m, 'worker_cpu_ms_per_job'), '{:.2f}')} |")
    raw = [json.dumps({"name": f"relay {x}", "trials": relay[x].trials}) for x in MODES]
    raw += [json.dumps({"name": f"lateness {p} {x} {r:g}", "trials": m.trials})
            for (p, x, r), m in late.items()]
    lines += ["", "<details><summary>raw trial data</summary>", "", "```json", *raw, "```", "",
              "</details>"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--restart", action="store_true", help="stop_app/start_app with N pending")
    p.add_argument("--wait-quiet", type=float, default=0.0)
    p.add_argument("--pg-url", default=os.environ.get("DUEBOX_BENCH_PG", DEFAULT_PG))
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    a = p.parse_args()
    command = "python bench/amqp_delays.py " + shlex.join(sys.argv[1:])
    started, load_start = time.monotonic(), os.getloadavg()
    machine = backends_report.machine_info(a.pg_url) + backends_report.backend_versions("amqp")
    relay = {x: Measurement("relay", x) for x in MODES}
    late: dict[tuple[str, str, float], Measurement] = {}
    with pg_database(a.pg_url) as db:
        for mode in MODES:
            for _ in range(a.repeats):
                relay_trial(relay[mode], mode, db, a.n, a.restart, a.wait_quiet)
        for path, near in (("default", None), ("broker", 0.0)):
            for rate in RATES:
                for mode in MODES:
                    m = late[(path, mode, rate)] = Measurement(f"lateness {path} {rate:g}/s", mode)
                    for _ in range(a.repeats):
                        lateness_trial(m, mode, db, rate, a.seconds, near, a.wait_quiet)
    header = [f"Generated by `{command}` in {(time.monotonic() - started) / 60:.1f} min; "
              f"{a.repeats} trial(s) per figure, each in a fresh process; figures are the "
              "median with the range (min–max) in brackets.  The machine is shared and was "
              "loaded (other sessions' tests and benchmarks): load average at start "
              f"{' / '.join(f'{x:.2f}' for x in load_start)}, at the end "
              f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min).", "",
              *backends_report.machine_table(machine)]
    text = section(relay, late, header, a.restart)
    backends_report.write_sections(a.output, {"amqp-delays": text})
    print(f"wrote the amqp-delays section of {a.output}")
    if any(m.error for m in [*relay.values(), *late.values()]):
        sys.exit(1)


if __name__ == "__main__":
    main()
