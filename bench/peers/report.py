"""RESULTS.md from results.json: medians and ranges over the runs, ratios
(duebox ÷ peer on the same backend), the reference figures, the targets'
pass/miss lines, the profile and the machine."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from systems import BACKEND

HERE = Path(__file__).resolve().parent
DUEBOX_ON: dict[str, str] = {"pg": "duebox-sql", "redis": "duebox-redis", "amqp": "duebox-amqp",
             "kafka": "duebox-kafka", "sqs": "duebox-sqs"}

# Measured on this machine before duebox existed (issue #8): the bar.
REFERENCE = [
    ("Celery, RabbitMQ", "~1,300", "~1.7 / ~5 ms", "—"),
    ("Celery, Redis", "~570", "~1.8 / ~3 ms", "—"),
    ("Dramatiq, RabbitMQ", "~3,300", "~510 / ~990 ms", "52 / 101 ms (worker timeout 100 ms)"),
    ("Dramatiq, Redis", "~2,300", "~540 / ~1,490 ms", "58 / 133 ms"),
    ("pgqueuer (batch 10), PostgreSQL", "~3,550", "~54 / ~108 ms", "—"),
    ("procrastinate, PostgreSQL", "~230", "~3,040 / ~4,960 ms (5 s poll)",
     "54 / 104 ms (0.1 s poll)"),
]


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return values[min(len(values) - 1, max(0, round(p / 100 * len(values) + 0.5) - 1))]


MIXED = (("C", "C"), ("C_burst", "C-burst"))  # workload C's forms: results key, name
LATE_MS = 500  # workload C: a fast job later than this counts as held back


def lateness_stats(late: list[float]) -> dict[str, float]:
    return {"p50": pct(late, 50), "p99": pct(late, 99), "max": late[-1],
            "early": float(sum(1 for x in late if x < 0))}


def stats(res: dict[str, Any]) -> dict[str, float]:
    """A lateness result's figures; for workload C, of the fast jobs
    (``late_ms``), with the slow jobs' (``slow_late_ms``) and early starts
    of both."""
    out = lateness_stats(res["late_ms"])
    slow = res.get("slow_late_ms")
    if slow is not None:
        out["over"] = float(sum(1 for x in res["late_ms"] if x > LATE_MS))
        out["fast"] = float(len(res["late_ms"]))
        out["repeats"] = float(res.get("repeats", 0))
        out["early"] += sum(1 for x in slow if x < 0)
        if slow:
            out["slow_p50"], out["slow_max"] = pct(slow, 50), slow[-1]
        if "cpu" in res:
            out["cpu_own"], out["cpu_total"] = res["cpu"]["own_ms"], res["cpu"]["total_ms"]
    return out


def _one_throughput(a: dict[str, Any]) -> str:
    return (f"A enqueue {a['enqueue_rate']:,.0f}/s process {a['process_rate']:,.0f}/s"
            + ("" if "cpu" not in a else
               " cpu/job ms: " + " ".join(f"{k[:-3]} {v:.2f}" for k, v in a["cpu"].items())))


def one_line(res: dict[str, Any]) -> str:
    parts = []
    for key, r in res.items():
        if "error" in r:
            parts.append(f"{key} {r['error']}")
        elif key == "A":
            parts.append(_one_throughput(r))
        else:
            s = stats(r)
            parts.append(f"{key} p50 {s['p50']:.1f} p99 {s['p99']:.1f} max {s['max']:.1f} "
                         f"early {s['early']:.0f}"
                         + ("" if "over" not in s else
                            f" >{LATE_MS}ms {s['over']:.0f}/{s['fast']:.0f}"
                            f" slow p50 {s.get('slow_p50', 0):.1f} max {s.get('slow_max', 0):.1f}"
                            f" repeats {s['repeats']:.0f} cpu/job {s.get('cpu_total', 0):.2f} ms"))
    return "; ".join(parts)


class Table:
    """Per system and workload: the values of each run (errors kept apart)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.runs = data["runs"]

    def values(self, system: str, workload: str, field: str) -> list[float]:
        out = []
        for run in self.runs:
            res = run["results"].get(system, {}).get(workload)
            if res is None or "error" in res:
                continue
            if "late_ms" in res:
                if field in (figures := stats(res)):
                    out.append(figures[field])
            else:
                out.append(float(res[field]))
        return out

    def errors(self, system: str, workload: str) -> list[str]:
        return [run["results"][system][workload]["error"] for run in self.runs
                if "error" in run["results"].get(system, {}).get(workload, {})]

    def median(self, system: str, workload: str, field: str) -> float | None:
        v = self.values(system, workload, field)
        return statistics.median(v) if v else None


def fmt(v: list[float], unit: str = "", digits: int = 0) -> str:
    if not v:
        return "failed"
    m = statistics.median(v)
    spec = f",.{digits}f"
    text = f"{m:{spec}}{unit}"
    return text + (f" ({min(v):{spec}}–{max(v):{spec}})" if len(v) > 1 else "")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "—"


def _systems(data: dict[str, Any]) -> list[dict[str, Any]]:
    return list(data["systems"])


def _how(t: Table, name: str) -> str:
    for run in t.runs:
        a = run["results"].get(name, {}).get("A", {})
        if "enqueue_how" in a:
            return str(a["enqueue_how"])
    return "—"


def throughput_table(t: Table) -> list[str]:
    lines = ["| system | backend | enqueue API | enqueue jobs/s | processing jobs/s "
             "| worker spawn → last start, s | duebox ÷ peer (enqueue / processing) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in _systems(t.data):
        name, own = s["name"], DUEBOX_ON[s["broker"]]
        r = "—"
        if s["module"] != "duebox" and own in {x["name"] for x in _systems(t.data)}:
            r = " / ".join(ratio(t.median(own, "A", f), t.median(name, "A", f))
                           for f in ("enqueue_rate", "process_rate"))
        lines.append(f"| {name} | {BACKEND[s['broker']]} | {_how(t, name)} "
                     f"| {fmt(t.values(name, 'A', 'enqueue_rate'))} "
                     f"| {fmt(t.values(name, 'A', 'process_rate'))} "
                     f"| {fmt(t.values(name, 'A', 'spawn_to_done_s'), digits=1)} | {r} |")
    return lines


def summary_table(t: Table) -> list[str]:
    """Issue #20's table: processing jobs/s per backend, duebox beside its peers."""
    rows = (("pg", "duebox-sql", (), (), ("pgqueuer",)),
            ("redis", "duebox-redis", ("celery-redis",), ("dramatiq-redis", "dramatiq-redis-1p"),
             ()),
            ("amqp", "duebox-amqp", ("celery-amqp",), ("dramatiq-amqp", "dramatiq-amqp-1p"), ()))

    def cell(names: tuple[str, ...]) -> str:
        vals = [t.median(n, "A", "process_rate") for n in names]
        return " / ".join("—" if v is None else f"{v:,.0f}" for v in vals) if names else "—"

    out = ["| backend | duebox | Celery | Dramatiq (1 per CPU / 1 proc) | pgqueuer "
           "| duebox ÷ best peer |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for broker, own, celery, dramatiq, pgq in rows:
        mine = t.median(own, "A", "process_rate")
        peers = [v for n in (*celery, *dramatiq, *pgq) if (v := t.median(n, "A", "process_rate"))]
        if mine is None and not peers:
            continue
        out.append(f"| {BACKEND[broker]} | {'—' if mine is None else f'{mine:,.0f}'} "
                   f"| {cell(celery)} | {cell(dramatiq)} | {cell(pgq)} "
                   f"| {ratio(mine, max(peers) if peers else None)} |")
    return out


def cpu_table(t: Table) -> list[str]:
    """CPU ms per job of workload A, every process counted (bench/peers/cpu.py)."""
    out = ["| system | backend | own processes | of which relay / worker | database server "
           "| broker | total |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in _systems(t.data):
        cpus = [r["results"][s["name"]]["A"]["cpu"] for r in t.runs
                if "cpu" in r["results"].get(s["name"], {}).get("A", {})]
        if not cpus:
            continue

        def med(key: str, cpus: list[dict[str, float]] = cpus) -> str:
            v = [c[key] for c in cpus if key in c]
            return f"{statistics.median(v):.2f}" if v else "—"

        split = f"{med('relay_ms')} / {med('worker_ms')}" if s["module"] == "duebox" else "—"
        out.append(f"| {s['name']} | {BACKEND[s['broker']]} | {med('own_ms')} | {split} "
                   f"| {med('database_ms')} | {med('broker_ms')} | {med('total_ms')} |")
    return out


def lateness_table(t: Table) -> list[str]:
    lines = ["| system | backend | setting | p50 ms | p99 ms | max ms | early "
             "| duebox ÷ peer (p50 / p99, same setting kind) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    names = {x["name"] for x in _systems(t.data)}
    for s in _systems(t.data):
        name, own = s["name"], DUEBOX_ON[s["broker"]]
        fast = t.data["settings"].get("fast_late_jobs") or 0
        rate = t.data["settings"]["late_jobs"] / t.data["settings"]["spread"]
        for key, setting in ((("B", f"default, {rate:,.0f} jobs/s"),
                              ("B_fast", f"default, {fast / t.data['settings']['spread']:,.0f}"
                                         " jobs/s"),
                              ("B_aggr", None if s["aggressive"] is None
                               else f"{s['aggressive']}, {rate:,.0f} jobs/s"))):
            if setting is None or (key == "B_fast" and not fast):
                continue
            r = "—"
            if s["module"] != "duebox" and own in names:
                r = (f"{ratio(t.median(own, key, 'p50'), t.median(name, key, 'p50'))} / "
                     f"{ratio(t.median(own, key, 'p99'), t.median(name, key, 'p99'))}")
            lines.append(
                f"| {name} | {BACKEND[s['broker']]} | {setting} "
                f"| {fmt(t.values(name, key, 'p50'), digits=1)} "
                f"| {fmt(t.values(name, key, 'p99'), digits=1)} "
                f"| {fmt(t.values(name, key, 'max'), digits=1)} "
                f"| {fmt(t.values(name, key, 'early'))} | {r} |")
    return lines


# Per backend: duebox's system and its peers on the same servers (the Summary's rows).
PEERS_ON = (("pg", "duebox-sql", ("pgqueuer", "procrastinate")),
            ("redis", "duebox-redis", ("celery-redis", "dramatiq-redis", "dramatiq-redis-1p")),
            ("amqp", "duebox-amqp", ("celery-amqp", "dramatiq-amqp", "dramatiq-amqp-1p")))


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f}"


def _ms2(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def mixed_table(t: Table) -> list[str]:
    """Workload C, both forms: the fast jobs' lateness, the slow ones', CPU."""
    lines = [f"| system | backend | form | fast p50 ms | fast p99 ms | fast max ms "
             f"| fast > {LATE_MS} ms | slow p50 / max ms | early | started twice "
             "| CPU ms/job (own / total) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in _systems(t.data):
        name = s["name"]
        for key, form in MIXED:
            if not any(key in run["results"].get(name, {}) for run in t.runs):
                continue
            def med(field: str, name: str = name, key: str = key) -> float | None:
                return t.median(name, key, field)

            fast = "—" if (n := med("fast")) is None else f"{n:,.0f}"
            lines.append(
                f"| {name} | {BACKEND[s['broker']]} | {form} "
                f"| {fmt(t.values(name, key, 'p50'), digits=1)} "
                f"| {fmt(t.values(name, key, 'p99'), digits=1)} "
                f"| {fmt(t.values(name, key, 'max'), digits=1)} "
                f"| {fmt(t.values(name, key, 'over'))} of {fast} "
                f"| {_ms(med('slow_p50'))} / {_ms(med('slow_max'))} "
                f"| {fmt(t.values(name, key, 'early'))} | {fmt(t.values(name, key, 'repeats'))} "
                f"| {_ms2(med('cpu_own'))} / {_ms2(med('cpu_total'))} |")
    return lines


def best_peer(t: Table, peers: tuple[str, ...], key: str) -> str | None:
    """The peer whose fast jobs' p99 (then max) is lowest in this run."""
    ranked = [(p99, t.median(p, key, "max") or 0.0, p) for p in peers
              if (p99 := t.median(p, key, "p99")) is not None]
    return min(ranked)[2] if ranked else None


def mixed_summary(t: Table) -> list[str]:
    """Issue #32's headline: duebox's fast jobs beside the best peer's."""
    out = ["| backend | form | duebox fast p99 / max ms | best peer | its fast p99 / max ms "
           "| duebox ÷ best peer (p99 / max) |", "| --- | --- | ---: | --- | ---: | ---: |"]
    for broker, own, peers in PEERS_ON:
        for key, form in MIXED:
            p99, mx = t.median(own, key, "p99"), t.median(own, key, "max")
            best = best_peer(t, peers, key)
            if p99 is None and best is None:
                continue
            b99 = t.median(best, key, "p99") if best else None
            bmx = t.median(best, key, "max") if best else None
            out.append(f"| {BACKEND[broker]} | {form} | {_ms(p99)} / {_ms(mx)} "
                       f"| {best or '—'} | {_ms(b99)} / {_ms(bmx)} "
                       f"| {ratio(p99, b99)} / {ratio(mx, bmx)} |")
    return out


def mixed_targets(t: Table, line: Any) -> None:
    """Issue #32: fast p99 <= 20 ms and max <= 250 ms on sql://, Redis and
    RabbitMQ, no early start, ahead of every peer in the same run."""
    names = {x["name"] for x in _systems(t.data)}
    peers = [n for _, _, ps in PEERS_ON for n in ps if n in names]
    for _, d, _ in PEERS_ON:
        for key, form in MIXED:
            p99, mx = t.median(d, key, "p99"), t.median(d, key, "max")
            if d not in names or not any(key in r["results"].get(d, {}) for r in t.runs):
                continue
            if p99 is None or mx is None:
                line(None, f"(issue #32) {d} workload {form}: no result "
                           f"({'; '.join(t.errors(d, key))})")
                continue
            early = sum(t.values(d, key, "early"))
            theirs = [(p, p99_, mx_) for p in peers if (p99_ := t.median(p, key, "p99"))
                      is not None and (mx_ := t.median(p, key, "max")) is not None]
            behind = [p for p, a, b in theirs if p99 >= a or mx >= b]
            ahead = (f"not of {', '.join(behind)}" if behind else "yes" if theirs
                     else "no peer measured")
            line(p99 <= 20 and mx <= 250 and early == 0 and not behind,
                 f"(issue #32) {d} workload {form}, fast jobs: p99 {p99:,.1f} ms (≤ 20), "
                 f"max {mx:,.1f} ms (≤ 250), early {early:.0f} (= 0), ahead of every peer's "
                 f"p99 and max: {ahead}")


def targets(t: Table) -> list[str]:
    names = {x["name"] for x in _systems(t.data)}
    out = []

    def line(ok: bool | None, text: str) -> None:
        out.append(f"- **{'PASS' if ok else 'MISS' if ok is not None else 'N/A'}** — {text}")

    for d in ("duebox-sql", "duebox-redis", "duebox-amqp", "duebox-kafka"):
        if d not in names or "B" not in _ran(t.data):
            continue
        for key, label in (("B", "default settings"), ("B_aggr", "aggressive polling")):
            p50, p99 = t.median(d, key, "p50"), t.median(d, key, "p99")
            early = sum(t.values(d, key, "early"))
            if p50 is None or p99 is None:
                line(None, f"{d} lateness ({label}): no result ({'; '.join(t.errors(d, key))})")
                continue
            line(p99 <= 5 and p50 <= 2 and early == 0,
                 f"{d} lateness, {label}: p50 {p50:.1f} ms (≤ 2), p99 {p99:.1f} ms (≤ 5), "
                 f"early {early:.0f} (= 0) — medians of the runs, early summed")
        fp99 = t.median(d, "B_fast", "p99")
        if fp99 is not None:
            early = sum(t.values(d, "B_fast", "early"))
            line(fp99 <= 20 and early == 0,
                 f"{d} lateness at speed (default settings): p99 {fp99:.1f} ms (≤ 20), "
                 f"early {early:.0f} (= 0)")
    for d, peers, factor in (("duebox-redis", ("celery-redis",), 1.0),
                             ("duebox-amqp", ("celery-amqp",), 1.0),
                             ("duebox-sql", ("pgqueuer",), 1.0),
                             ("duebox-redis", ("dramatiq-redis", "dramatiq-redis-1p"), 1.0),
                             ("duebox-amqp", ("dramatiq-amqp", "dramatiq-amqp-1p"), 1.0),
                             ("duebox-sql", ("pgqueuer", "procrastinate"), 1.5)):
        mine = t.median(d, "A", "process_rate")
        theirs: dict[str, float] = {}
        for p in peers:
            v = t.median(p, "A", "process_rate") if p in names else None
            if v is not None:
                theirs[p] = v
        if d not in names or mine is None or not theirs:
            continue
        best = max(theirs, key=lambda p: theirs[p])
        bar = factor * theirs[best]
        kind = "issue #20 done" if factor == 1.0 and not best.startswith("dramatiq") \
            else "issue #20 goal"
        line(mine >= bar, f"({kind}) {d} processing {mine:,.0f} jobs/s ≥ "
             f"{f'{factor:.1f}× ' if factor != 1 else ''}best peer {best} "
             f"{theirs[best]:,.0f} = {bar:,.0f}")
    for d in sorted(n for n in names if n.startswith("duebox-")):
        e = t.median(d, "A", "enqueue_rate")
        if e is not None:
            line(e >= 20_000, f"{d} enqueue (app.schedule_many in one transaction) "
                 f"{e:,.0f} jobs/s ≥ 20,000")
    mixed_targets(t, line)
    return out


def profile_section(data: dict[str, Any]) -> list[str]:
    profiles = data.get("profiles") or {}
    if not profiles:
        return ["Not run (--no-profile).", ""]
    out = ["Workload A once more, each process under `py-spy record --rate 200 --format raw "
           "--subprocesses` (every thread sampled, also while it waits).  Samples whose top "
           "frame is a wait are grouped by kind; of the rest, the top functions by self "
           "samples (all code) and by inclusive samples (duebox's own functions, without the "
           "CLI wrappers), as % of the process's working (not waiting) samples; the waits "
           "are % of all its thread samples (an idle thread pool weighs a lot there).  "
           "py-spy slows the process "
           "somewhat, so the rate below is lower than in the table above.", ""]
    for system, p in profiles.items():
        a = p["throughput"]
        out += [f"### {system}: " + (f"processing {a['process_rate']:,.0f} jobs/s under py-spy"
                                     if "error" not in a else a["error"]), ""]
        for process, s in p["processes"].items():
            waits = ", ".join(f"{w} {v} %" for w, v in s["waits"])
            out += [f"**{process}** — {s['samples']:,} thread samples, {s['busy']:,} working; "
                    f"waiting: {waits or 'none'}", "",
                    "| self % | function (all code) | inclusive % | function (duebox) |",
                    "| --- | --- | --- | --- |"]
            for i in range(max(len(s["inclusive"]), len(s["self"]))):
                own = s["self"][i] if i < len(s["self"]) else ("", "")
                inc = s["inclusive"][i] if i < len(s["inclusive"]) else ("", "")
                out.append(f"| {own[1]} | `{own[0]}` | {inc[1]} | `{inc[0]}` |".replace("``", ""))
            out.append("")
    return out


def _ran(data: dict[str, Any]) -> list[str]:
    """The workloads this run measured (results.json before #32: A and B)."""
    return list(data["settings"].get("workloads", ["A", "B"]))


def _not_run(title: str) -> list[str]:
    return [title, "", "Not run (`--workloads`).", ""]


def summary_section(t: Table) -> list[str]:
    ran = _ran(t.data)
    out = []
    if "C" in ran or "C-burst" in ran:
        out += ["## Summary (issue #32): a slow handler never holds a fast job back", "",
                "Workload C: the fast jobs' start lateness, duebox beside the best peer on "
                "the same servers (the lowest fast-job p99), medians of the runs; ratio < 1: "
                "duebox's fast jobs start closer to their due time.", "",
                *mixed_summary(t), ""]
    if "A" in ran:
        out += ["## Summary (issue #20)", "", "Workload A's processing jobs/s, medians of "
                "the runs.", "", *summary_table(t), ""]
    return out


def throughput_section(t: Table) -> list[str]:
    if "A" not in _ran(t.data):
        return _not_run("## Workload A — throughput")
    return [
        "## Workload A — throughput",
        "",
        f"{t.data['settings']['jobs']:,} no-op jobs due now are enqueued with the worker "
        "stopped (timed in "
        "the enqueuing process, connection included); then the system's worker starts "
        "with its defaults (duebox and Dramatiq: one process per CPU, Celery: a prefork pool "
        "of one child per CPU, pgqueuer and procrastinate: one process; the `-1p` rows: "
        "Dramatiq in one process).  Processing jobs/s = (N − 1) / (last start − "
        "first start), so worker start-up is excluded; the next column includes it. "
        "duebox runs a relay process beside its worker (that is its architecture: on "
        "broker backends the relay moves due jobs from the outbox table to the broker, so "
        "its processing rate is outbox → broker → handler end to end).",
        "",
        *throughput_table(t),
        "",
        "Ratio: duebox on the same backend ÷ this peer (> 1: duebox is faster).  The "
        "peers' processing rate is broker → handler; duebox's, on broker backends, "
        "outbox table → relay → broker → handler.",
        "",
        "CPU ms per job over workload A, from /proc (bench/peers/cpu.py): the system's own "
        "processes exactly; PostgreSQL's backends of the workload's database and its shared "
        "processes, and the broker's server, as upper bounds (other work on the machine "
        "lands there too).",
        "",
        *cpu_table(t),
        "",
    ]


def lateness_section(t: Table) -> list[str]:
    if "B" not in _ran(t.data):
        return _not_run("## Workload B — lateness")
    st = t.data["settings"]
    return [
        "## Workload B — lateness",
        "",
        f"{st['late_jobs']:,} (and, at speed, {st.get('fast_late_jobs') or 0:,}) no-op jobs "
        f"due at distinct times spread evenly over "
        f"{st['spread']:g} s, the first {st['lead']:g} s after the enqueue starts (so every "
        "job is enqueued before it is due), with the worker already running (a warm-up job "
        "has run).  Lateness = handler start − due time, both from this machine's clock; "
        "early = started before its due time.  Each system with its defaults, then with "
        "the most aggressive documented polling setting where one exists.",
        "",
        *lateness_table(t),
        "",
        "Ratio: duebox on the same backend ÷ this peer, default row against default row and "
        "aggressive against aggressive (< 1: duebox starts jobs closer to their due time).",
        "",
        "Notes: Celery has no polling setting for ETA tasks (the worker receives them at "
        "once and holds them on a timer), so it has one row.  The Kafka broker is "
        "librdkafka's mock cluster (tests/services/kafka_mock.py), which answers a fetch "
        "only when `fetch_max_wait_ms` expires: duebox's default 500 ms shows directly in "
        "its default-settings lateness; a real Kafka answers as soon as data arrives.",
        "",
    ]


def mixed_section(t: Table) -> list[str]:
    ran = _ran(t.data)
    if "C" not in ran and "C-burst" not in ran:
        return _not_run("## Workload C — mixed durations")
    st = t.data["settings"]
    c, burst = st["mixed"]["C"], st["mixed"]["C_burst"]
    return [
        "## Workload C — mixed durations",
        "",
        f"As workload B, one task, {c['n']:,} jobs due at distinct times spread evenly over "
        f"{st['spread']:g} s from {st['lead']:g} s after the enqueue starts, the worker "
        f"already running and warmed up ({c['warmup']} jobs run); but every "
        f"{c['slow_every']}th job is slow: its handler records its start, then sleeps "
        f"{c['slow']:g} s (the peers' async handlers, pgqueuer's and procrastinate's, await "
        "`asyncio.sleep`); the rest are the no-op.  **C-burst** adds "
        f"{burst['burst']} slow jobs of {burst['burst_sleep']:g} s all due at one instant "
        f"{burst['burst_at']:g} s "
        "into the spread, among the fast ones (fewer than duebox's and Dramatiq's default "
        "threads, 2 processes × 8 here; the peers at their defaults).  Every system at its "
        "defaults.  Lateness = handler start − due time, of the fast jobs, and apart of the "
        f"slow ones; fast > {LATE_MS} ms: fast jobs held back (of all fast jobs); early: "
        "fast and slow jobs started before their due time (must be 0); each job's lateness is "
        "its first start's, and started twice counts the handler starts beyond one per job "
        "(without a fault: should be 0).  CPU ms per job: as "
        "workload A's (bench/peers/cpu.py), from just before the enqueue to the last start, "
        "over all jobs of the form.",
        "",
        *mixed_table(t),
        "",
    ]


def write(data: dict[str, Any]) -> None:
    t = Table(data)
    m = data["machine"]
    loads = "; ".join(f"run {i + 1}: {r['load_start'][0]:.2f} → {r['load_end'][0]:.2f}"
                      for i, r in enumerate(data["runs"]))
    errors = [f"- {s['name']} {w}: {e}" for s in _systems(data)
              for w in ("A", "B", "B_fast", "B_aggr", "C", "C_burst")
              for e in t.errors(s["name"], w)]
    lines = [
        "# duebox and its peers, side by side (issue #8)",
        "",
        f"Measured {data['started']} → {data['finished']} UTC, wall time "
        f"{data['wall_s'] / 60:.1f} min, {len(data['runs'])} run(s); each cell is the "
        "median of the runs with the range (min–max) in brackets.  Command:",
        "",
        "```sh",
        data["command"],
        "python bench/peers/run.py --quick       # 2,000 + 100 jobs, 1 run: checks the harness",
        "python bench/peers/run.py --report-only # re-render this file from results.json",
        "```",
        "",
        *([data["note"], ""] if data.get("note") else []),
        "**Noise.** This machine has "
        f"{m['nproc']} CPUs and was shared with other work while this ran (load average, "
        f"1 min, at the start → end of each run: {loads}).  Servers, enqueuer, worker and "
        "relay all share those CPUs; read differences under ~20 % as noise.",
        "",
        *summary_section(t),
        *throughput_section(t),
        *lateness_section(t),
        *mixed_section(t),
        "## Targets (computed from this run)",
        "",
        *targets(t),
        "",
        "## Reference: measured on this machine before duebox existed (issue #8)",
        "",
        "| peer | throughput jobs/s | lateness p50 / p99, default | aggressive polling |",
        "| --- | --- | --- | --- |",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in REFERENCE],
        "",
        "## Where duebox's time goes (py-spy)",
        "",
        *profile_section(data),
        "## Failures",
        "",
        *(errors or ["None: every system completed every workload in every run."]),
        "",
        "## Machine and versions",
        "",
        f"- CPUs: {m['nproc']} × {m['cpu']}; RAM {m['ram_gib']} GiB; Linux {m['kernel']}; "
        f"Python {m['python']}",
        "- Servers: " + ", ".join(f"{k} {v}" for k, v in m["servers"].items()),
        "- Packages (bench venv): " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()),
        "",
        "## Settings of each system",
        "",
        *[f"- {s['module']}: {_docstring(s['module'])}" for s in _dedupe_modules(_systems(data))],
        "",
    ]
    (HERE / "RESULTS.md").write_text("\n".join(lines))


def _docstring(module: str) -> str:
    """The peer module's docstring: how that system is set up and run."""
    text = (HERE / f"peer_{module}.py").read_text()
    return " ".join(text.split('"""')[1].split())


def _dedupe_modules(systems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for s in systems:
        if s["module"] not in seen:
            seen.add(s["module"])
            out.append(s)
    return out
