"""``duebox status``: one screen that answers "is it healthy?".

Everything comes from bounded, index-backed reads: the same snapshot the
relay's metrics collector takes (:func:`duebox.metrics.read_snapshot`), state
counts capped per state, a capped sample of recently started jobs for start
lateness, and the process registry in ``duebox_lease``.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, select

from duebox.db import SQLITE_DEFERRED, db_errors
from duebox.metrics import DEFAULT_COUNT_CAP, Group, read_snapshot, seconds
from duebox.states import JobState
from duebox.tables import job, lease, rate_bucket
from duebox.values import shown

# Jobs due this long before the window may still have started inside it; a
# job started later than this after its due time is outside the sample (its
# lateness shows in the oldest due age while it waits).
_LOOKBACK = timedelta(hours=1)
_SAMPLE_CAP = 5000
_STARTED_STATES = (JobState.RUNNING, JobState.SUCCEEDED, JobState.DEAD)


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of a sorted list."""
    if not values:
        return None
    return values[max(0, math.ceil(q * len(values)) - 1)]


def _state_counts(conn: Any, cap: int) -> tuple[dict[str, int], bool]:
    counts, capped = {}, False
    for state in JobState:
        ids = select(job.c.id).where(job.c.state == state).limit(cap).subquery()
        n = int(conn.execute(select(func.count()).select_from(ids)).scalar_one())
        if n:
            counts[str(state)] = n
            capped |= n >= cap
    return counts, capped


def _lateness_sample(conn: Any, now: datetime, window: float) -> list[Any]:
    """(queue, tenant, start - due) of up to ``_SAMPLE_CAP`` jobs started in
    the last ``window`` seconds, newest due first: a range of the
    ``(state, due_at)`` index, no index on ``started_at`` needed."""
    since = now - timedelta(seconds=window)
    return list(conn.execute(
        select(job.c.queue, job.c.tenant, job.c.due_at, job.c.started_at)
        .where(job.c.state.in_(list(_STARTED_STATES)),
               job.c.due_at >= since - _LOOKBACK, job.c.due_at <= now,
               job.c.started_at >= since)
        .order_by(job.c.due_at.desc()).limit(_SAMPLE_CAP)
    ).all())


def _group_view(g: Group | None, now: datetime, late: list[float]) -> dict[str, Any]:
    g = g or Group()
    late.sort()
    return {
        "due_backlog": g.due_backlog,
        "oldest_due_age_s": seconds(now, g.oldest_due_at) if g.oldest_due_at else 0.0,
        "overdue": g.overdue,
        "in_flight": sum(g.in_flight.values()),
        "in_flight_by_state": dict(sorted(g.in_flight.items())),
        "dlq": g.dlq,
        "dlq_oldest_age_s": seconds(now, g.oldest_dlq_at) if g.oldest_dlq_at else 0.0,
        "started_recently": len(late),
        "lateness_p50_s": _percentile(late, 0.50),
        "lateness_p99_s": _percentile(late, 0.99),
    }


def _process_view(p: Any, now: datetime) -> dict[str, Any]:
    return {
        "name": p.name,
        "heartbeat_age_s": seconds(now, p.heartbeat_at) if p.heartbeat_at else None,
        "expires_in_s": (p.expires_at - now).total_seconds(),
        "info": p.info,
    }


def _shards(conn: Any, now: datetime) -> list[dict[str, Any]]:
    """Shard leases (relay/shards.py): a bounded read, one row per shard."""
    rows = conn.execute(
        select(lease.c.name, lease.c.owner, lease.c.epoch, lease.c.expires_at)
        .where(lease.c.name.like("shard:%")).order_by(lease.c.name).limit(1024)).all()
    out = []
    for name, owner, epoch, expires_at in rows:
        live = owner is not None and expires_at is not None and expires_at > now
        out.append({"shard": name.removeprefix("shard:"), "owner": owner if live else None,
                    "generation": int(epoch),
                    "expires_in_s": (expires_at - now).total_seconds() if live else None})
    return out


def _buckets(conn: Any) -> list[dict[str, Any]]:
    """Shared rate-limit buckets (core/rate_buckets.py) and their last level."""
    rows = conn.execute(select(rate_bucket.c.name, rate_bucket.c.tokens, rate_bucket.c.updated_at)
                        .order_by(rate_bucket.c.name).limit(200)).all()
    return [{"bucket": n, "tokens": round(float(t), 1), "updated_at": u.isoformat()}
            for n, t, u in rows]


def build_report(engine: Engine, now: datetime, *, window: float = 300.0,
                 max_due_age: float = 60.0, overdue_after: float = 60.0,
                 cap: int = DEFAULT_COUNT_CAP, top_tenants: int = 20) -> dict[str, Any]:
    reader = engine.execution_options(**{SQLITE_DEFERRED: True})
    with db_errors("status"), reader.connect() as conn:
        states, states_capped = _state_counts(conn, cap)
        snap = read_snapshot(conn, now, overdue_after=overdue_after, cap=cap,
                             top_tenants=top_tenants)
        sample = _lateness_sample(conn, now, window)
        shards = _shards(conn, now)
        buckets = _buckets(conn)
    late_q: dict[str, list[float]] = {}
    late_t: dict[str, list[float]] = {}
    for queue, tenant, due_at, started_at in sample:
        lateness = (started_at - due_at).total_seconds()
        late_q.setdefault(queue, []).append(lateness)
        late_t.setdefault(tenant or "", []).append(lateness)
    queues = {q: _group_view(snap.queues.get(q), now, late_q.get(q, []))
              for q in sorted(set(snap.queues) | set(late_q))}
    tenants = {t: _group_view(g, now, late_t.get(t, [])) for t, g in sorted(snap.tenants.items())}
    relays = [_process_view(p, now) for p in snap.processes if p.role == "relay"]
    for r in relays:
        r["shards"] = [s["shard"] for s in shards if s["owner"] == r["name"]]
    workers = [_process_view(p, now) for p in snap.processes if p.role == "worker"]

    problems: list[str] = []
    warnings: list[str] = []
    # Missing processes matter only when there is work for them.
    active = sum(n for state, n in states.items()
                 if state in ("SCHEDULED", "DISPATCHING", "ENQUEUED", "RUNNING"))
    idle = warnings if not active else problems
    if not relays:
        idle.append("no live relay: nothing claims, recovers leases or fires schedules")
    if not workers:
        idle.append("no live worker")
    orphans = [s["shard"] for s in shards if s["owner"] is None]
    if orphans and relays:
        warnings.append(f"shards with no live owner: {', '.join(orphans)} "
                        "(taken over within a relay pass; persistent means no relay shards)")
    for q, v in queues.items():
        if v["oldest_due_age_s"] > max_due_age:
            problems.append(f"queue {q}: oldest due job waited {v['oldest_due_age_s']:.0f} s "
                            f"(> {max_due_age:g} s)")
        if v["dlq"]:
            warnings.append(f"queue {q}: {v['dlq']} dead-lettered jobs "
                            f"(oldest {v['dlq_oldest_age_s']:.0f} s)")
    return {
        "at": now.isoformat(),
        "healthy": not problems,
        "problems": problems,
        "warnings": warnings,
        "states": states,
        "queues": queues,
        "tenants": tenants,
        "relays": relays,
        "workers": workers,
        "shards": shards,
        "rate_buckets": buckets,
        "outbox_publication_lag_s": snap.oldest_due_age(),
        "window_s": window,
        "capped": states_capped or snap.capped,
        "cap": cap,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


def _table(title: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    head = (f"{title:<20} {'backlog':>8} {'oldest':>8} {'overdue':>8} {'inflight':>8} "
            f"{'dlq':>6} {'started':>8} {'late p50':>9} {'late p99':>9}")
    lines = [head]
    for name, v in rows.items():
        lines.append(
            f"{shown(name or '(none)')[:20]:<20} {v['due_backlog']:>8} "
            f"{v['oldest_due_age_s']:>7.1f}s {v['overdue']:>8} {v['in_flight']:>8} "
            f"{v['dlq']:>6} {v['started_recently']:>8} {_ms(v['lateness_p50_s']):>9} "
            f"{_ms(v['lateness_p99_s']):>9}")
    if not rows:
        lines.append("  (none)")
    return lines


def render(report: dict[str, Any]) -> str:
    verdict = "HEALTHY" if report["healthy"] else "UNHEALTHY"
    lines = [f"duebox status at {report['at']}: {verdict}"]
    lines += [f"  ! {shown(p)}" for p in report["problems"]]
    lines += [f"  ~ {shown(w)}" for w in report["warnings"]]
    states = report["states"]
    lines.append("jobs by state: " + ("  ".join(f"{k} {v}" for k, v in sorted(states.items()))
                                      or "none")
                 + ("  (counts capped)" if report["capped"] else ""))
    lines.append(f"outbox publication lag {report['outbox_publication_lag_s']:.1f} s; "
                 f"lateness over the last {report['window_s']:g} s")
    lines.append("")
    lines += _table("queue", report["queues"])
    if report["tenants"]:
        lines.append("")
        lines += _table("tenant", report["tenants"])
    lines.append("")
    for role in ("relays", "workers"):
        procs = report[role]
        lines.append(f"{role} alive: {len(procs)}")
        for p in procs:
            age = p["heartbeat_age_s"]
            info = p["info"]
            owned = p.get("shards")
            lines.append(f"  {shown(p['name'])}  heartbeat {'-' if age is None else f'{age:.1f}s'} "
                         f"ago  backend {info.get('backend', '?')}  pid {info.get('pid', '?')}"
                         + (f"  shards {','.join(owned)}" if owned else ""))
    if report.get("shards"):
        lines.append("")
        lines.append(f"{'shard':<12} {'generation':>10} {'expires in':>11}  owner")
        for sh in report["shards"]:
            exp = sh["expires_in_s"]
            lines.append(f"{sh['shard']:<12} {sh['generation']:>10} "
                         f"{'-' if exp is None else f'{exp:.1f}s':>11}  "
                         f"{sh['owner'] or '(none)'}")
    if report.get("rate_buckets"):
        lines.append("")
        lines.append("rate buckets: " + "  ".join(f"{b['bucket']} {b['tokens']}"
                                                  for b in report["rate_buckets"]))
    return "\n".join(lines)
