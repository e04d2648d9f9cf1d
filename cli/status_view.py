"""``duebox status``: the health report (:mod:`duebox.reads.status`) as text."""

from __future__ import annotations

from duebox.reads.status import GroupView, StatusReport
from duebox.validation import shown


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


def _table(title: str, rows: dict[str, GroupView]) -> list[str]:
    head = (f"{title:<20} {'backlog':>8} {'oldest':>8} {'overdue':>8} {'inflight':>8} "
            f"{'dlq':>6} {'started':>8} {'late p50':>9} {'late p99':>9}")
    lines = [head]
    for name, v in rows.items():
        lines.append(
            f"{shown(name or '(none)')[:20]:<20} {v.due_backlog:>8} "
            f"{v.oldest_due_age_s:>7.1f}s {v.overdue:>8} {v.in_flight:>8} "
            f"{v.dlq:>6} {v.started_recently:>8} {_ms(v.lateness_p50_s):>9} "
            f"{_ms(v.lateness_p99_s):>9}")
    if not rows:
        lines.append("  (none)")
    return lines


def render(report: StatusReport) -> str:
    lines = [f"duebox status at {report.at}: {report.verdict.upper()}"]
    lines += [f"  ! {shown(p)}" for p in report.problems]
    lines += [f"  ~ {shown(w)}" for w in report.warnings]
    states = "  ".join(f"{k} {v}" for k, v in sorted(report.states.items())) or "none"
    lines.append(f"jobs by state: {states}" + ("  (counts capped)" if report.capped else ""))
    lines.append(f"outbox publication lag {report.outbox_publication_lag_s:.1f} s; "
                 f"lateness over the last {report.window_s:g} s")
    lines.append("")
    lines += _table("queue", report.queues)
    if report.tenants:
        lines.append("")
        lines += _table("tenant", report.tenants)
    lines.append("")
    for role, procs in (("relays", report.relays), ("workers", report.workers)):
        lines.append(f"{role} alive: {len(procs)}")
        for p in procs:
            age = p.heartbeat_age_s
            lines.append(f"  {shown(p.name)}  heartbeat {'-' if age is None else f'{age:.1f}s'} "
                         f"ago  backend {p.info.get('backend', '?')}  pid {p.info.get('pid', '?')}"
                         + (f"  shards {','.join(p.shards)}" if p.shards else ""))
    if report.shards:
        lines.append("")
        lines.append(f"{'shard':<12} {'generation':>10} {'expires in':>11}  owner")
        for sh in report.shards:
            exp = sh.expires_in_s
            lines.append(f"{sh.shard:<12} {sh.generation:>10} "
                         f"{'-' if exp is None else f'{exp:.1f}s':>11}  "
                         f"{sh.owner or '(none)'}")
    if report.rate_buckets:
        lines.append("")
        lines.append("rate buckets: " + "  ".join(f"{b.bucket} {b.tokens}"
                                                  for b in report.rate_buckets))
    return "\n".join(lines)
