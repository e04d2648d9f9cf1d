"""Exact accounting after the drain, straight from the database.

Expected to run: every planned job that was not cancelled (a ``cancel`` that
returned True) plus every occurrence of the recurring schedule.  Each must
have exactly one committed effect; a cancelled job none; no effect may start
before the due time asked for (measured on the database server's clock); and
every effect must belong to the lease generation the job completed with.
"""

from __future__ import annotations

import itertools
import statistics
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from duebox.tables import attempt, job, schedule
from tests.soak.app import SCHEDULE_NAME, effect, plan
from tests.soak.faults import FaultEvent
from tests.soak.fleet import Fleet

SAMPLE = 5  # job ids shown per failed count
ACTIVE = ("SCHEDULED", "DISPATCHING", "ENQUEUED", "RUNNING")


@dataclass
class Verdict:
    figures: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, what: str, ids: list[Any]) -> None:
        if ids:
            self.failures[what] = [str(i) for i in ids[:SAMPLE]] + (
                [f"... {len(ids)} in all"] if len(ids) > SAMPLE else [])


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def lateness_line(ms: list[float]) -> str:
    if not ms:
        return "n/a (no jobs)"
    return (f"p50 {pct(ms, 0.5):.0f} ms, p99 {pct(ms, 0.99):.0f} ms, max {max(ms):.0f} ms "
            f"({len(ms)} jobs)")


def judge(engine: sa.Engine, events: list[FaultEvent], fleet: Fleet) -> Verdict:
    v = Verdict()
    with engine.connect() as conn:
        plans = {r.job_id: r for r in conn.execute(sa.select(plan))}
        sched_id = conn.execute(sa.select(schedule.c.id)
                                .where(schedule.c.name == SCHEDULE_NAME)).scalar()
        jobs = {r.id: r for r in conn.execute(sa.select(
            job.c.id, job.c.state, job.c.lease_generation, job.c.schedule_id,
            job.c.nominal_fire_at, job.c.due_at))}
        effects = list(conn.execute(sa.select(effect)))
    occurrences = {i for i, r in jobs.items() if sched_id is not None
                   and r.schedule_id == sched_id}
    cancelled = {i for i, p in plans.items() if p.cancelled}
    expected = ({i for i in plans if i not in cancelled}) | occurrences
    by_job: defaultdict[Any, list[Any]] = defaultdict(list)
    for e in effects:
        by_job[e.job_id].append(e)

    f = v.figures
    f["jobs scheduled"] = len(plans)
    f["cancelled (cancel returned True)"] = len(cancelled)
    f["rescheduled"] = sum(1 for p in plans.values() if p.rescheduled)
    f["retried (flaky) jobs"] = sum(1 for p in plans.values() if p.kind == "flaky")
    f["recurring occurrences"] = len(occurrences)
    f["jobs that should have run"] = len(expected)
    f["effects"] = len(effects)
    f["final states"] = dict(Counter(r.state for r in jobs.values()))

    # Without an effect: lost if duebox put the job in a final state (DEAD,
    # EXPIRED, or SUCCEEDED with no effect), unfinished if it was still on its
    # way when the drain gave up (too slow, or stuck: both fail the run).
    missing = [i for i in expected if i not in by_job]
    lost = sorted(i for i in missing if jobs[i].state not in ACTIVE)
    unfinished = sorted(i for i in missing if jobs[i].state in ACTIVE)
    double = sorted(i for i, es in by_job.items() if len(es) > 1)
    ran_cancelled = sorted(i for i in cancelled if i in by_job)
    unknown = sorted(i for i in by_job if i not in plans and i not in occurrences)
    early = sorted({e.job_id for e in effects
                    if e.started_us < max(e.due_us, plans[e.job_id].due_us
                                          if e.job_id in plans else e.due_us)})
    stale = sorted({e.job_id for e in effects if e.job_id in jobs and e.job_id not in cancelled
                    and (jobs[e.job_id].state != "SUCCEEDED"
        or jobs[e.job_id].lease_generation != e.lease_generation)})
    missed = _missed_fires([jobs[i] for i in occurrences])
    for name, ids in (("lost", lost), ("unfinished at the drain deadline", unfinished),
                      ("double effects", double), ("early starts", early),
                      ("cancelled but ran", ran_cancelled),
                      ("stale-generation writes accepted", stale),
                      ("effects of unknown jobs", unknown),
                      ("missed recurring fires", missed)):
        f[name] = len(ids)
        v.fail(name, ids)
    # Late effects: lateness against the record's due time (a retry's own).
    late = [(e.started_us - e.due_us) / 1000 for e in effects]
    f["lateness, all jobs"] = lateness_line(late)
    in_fault = [(e.started_us - e.due_us) / 1000 for e in effects
                if _during(e.due_us / 1e6, events)]
    f["lateness, due during a fault"] = lateness_line(in_fault)
    f["faults injected"] = dict(Counter(ev.kind for ev in events))
    f["time to recover, by fault kind"] = _recovery(effects, events)
    f["peak memory (VmHWM)"] = {s.name: f"{s.peak_kib / 1024:.0f} MiB" for s in fleet.slots}
    return v


def _during(t: float, events: list[FaultEvent]) -> bool:
    return any(ev.start <= t <= ev.end + 1.0 for ev in events)


def _recovery(effects: list[Any], events: list[FaultEvent]) -> dict[str, str]:
    """For each fault: from its end until every job due between its start
    and its end had started (0 when all of them ran on time anyway)."""
    per_kind: defaultdict[str, list[float]] = defaultdict(list)
    for ev in events:
        lo, hi = ev.start * 1e6, ev.end * 1e6
        starts = [e.started_us for e in effects if lo <= e.due_us <= hi]
        if starts:
            per_kind[ev.kind].append(max(0.0, (max(starts) - hi) / 1e6))
    return {k: f"median {statistics.median(v):.2f} s, max {max(v):.2f} s (n={len(v)})"
            for k, v in sorted(per_kind.items())}


def _missed_fires(occurrences: list[Any]) -> list[str]:
    """Fire times of the every-2-s schedule with no occurrence between the first and last."""
    fires = sorted(o.nominal_fire_at for o in occurrences)
    missing = []
    for a, b in itertools.pairwise(fires):
        gap = (b - a).total_seconds()
        if gap > 2.0:
            missing.append(f"{a.isoformat()} .. {b.isoformat()} ({gap:.0f} s)")
    return missing


def render(v: Verdict, header: list[str]) -> str:
    lines = [*header, "", "| figure | value |", "| --- | --- |"]
    for k, val in v.figures.items():
        if isinstance(val, dict):
            val = ", ".join(f"{a}: {b}" for a, b in val.items()) or "none"
        lines.append(f"| {k} | {val} |")
    lines.append("")
    lines.append("**verdict: PASS**" if v.ok else "**verdict: FAIL**")
    for what, ids in v.failures.items():
        lines.append(f"- {what}: {', '.join(ids)}")
    return "\n".join(lines) + "\n"


def explain(engine: sa.Engine, v: Verdict, broker_state: str) -> str:
    """The job rows and attempts behind each failed count, for the report's
    reader: enough to start a reproduction without the dropped database."""
    out = []
    with engine.connect() as conn:
        for what, ids in v.failures.items():
            for raw in ids:
                if raw.startswith("..."):
                    continue
                try:
                    jid = uuid.UUID(raw.split()[0])
                except ValueError:
                    continue
                row = conn.execute(sa.select(job).where(job.c.id == jid)).first()
                out.append(f"[{what}] job {jid}: {dict(row._mapping) if row else 'no row'}")
                p = conn.execute(sa.select(plan).where(plan.c.job_id == jid)).first()
                out.append(f"    plan: {dict(p._mapping) if p else None}")
                for a in conn.execute(sa.select(attempt).where(attempt.c.job_id == jid)
                                      .order_by(attempt.c.number)):
                    out.append(f"    attempt: {dict(a._mapping)}")
                for e in conn.execute(sa.select(effect).where(effect.c.job_id == jid)):
                    out.append(f"    effect: {dict(e._mapping)}")
    out.append("broker: " + broker_state)
    return "\n".join(out) + "\n"
