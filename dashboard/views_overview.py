"""The overview: per queue and tenant numbers, lateness and what is coming."""

from __future__ import annotations

from duebox.reads.status import GroupView

from .charts import bar_chart, line_chart
from .context import Dashboard
from .reads import HORIZONS, WINDOW, read_overview
from .render import esc, link, notice, page, seconds, table
from .web import Request, Response, route


def _groups(title: str, groups: dict[str, GroupView], param: str) -> str:
    rows = []
    for name, v in groups.items():
        label = link("/jobs", name or "(none)", **{param: name}) if param == "queue" \
            else esc(name or "(none)")
        rows.append([
            label, esc(v.due_backlog), seconds(v.oldest_due_age_s), esc(v.in_flight),
            link("/dlq", v.dlq, queue=name) if param == "queue" else esc(v.dlq),
            f"{v.started_recently * 60 / WINDOW:.1f}",
            seconds(v.lateness_p50_s), seconds(v.lateness_p99_s)])
    return table([title, "due backlog", "oldest due", "in flight", "DLQ", "started/min",
                  "late p50", "late p99"], rows, cls="numbers")


@route("GET", r"/")
def overview(d: Dashboard, request: Request) -> Response:
    o = read_overview(d, request.query)
    report, late, ahead = o.report, o.lateness, o.due
    look = {"healthy": "ok", "degraded": "warn", "unhealthy": "bad"}[report.verdict]
    verdict = f'<p class="verdict {look}">{esc(report.verdict)}</p>'
    problems = "".join(notice(p, "bad") for p in report.problems)
    problems += "".join(notice(w, "warn") for w in report.warnings)
    states = " ".join(f'<span class=count>{esc(k)} <b>{esc(v)}</b></span>'
                      for k, v in sorted(report.states.items())) or "no jobs yet"
    capped = " (counts capped)" if report.capped else ""
    late_chart = line_chart(
        f"start lateness over the last hour ({d.scheme}://)",
        [f"{b.start:%H:%M}" for b in late],
        [(f"p50 {d.scheme}", [b.p50 for b in late]), (f"p99 {d.scheme}", [b.p99 for b in late])])
    # Schedules count too: their fire times are jobs to come.
    due_chart = bar_chart(f"jobs and schedule fire times due in the next {o.horizon}",
                          [f"{b.start:%H:%M}" for b in ahead],
                          [b.count + f for b, f in zip(ahead, o.fires, strict=True)])
    horizons = " ".join(link("/", k, ahead=k) for k in HORIZONS)
    live = (
        f"{verdict}{problems}<p class=states>{states}{esc(capped)}</p>"
        f"<p class=muted>at {esc(report.at)}, refreshed every {d.refresh:g} s; outbox "
        f"publication lag {seconds(report.outbox_publication_lag_s)}</p>"
        "<h2>Queues</h2>" + _groups("queue", report.queues, "queue")
        + "<h2>Tenants</h2>" + _groups("tenant", report.tenants, "tenant")
        + f"<div class=charts><section><h2>Lateness</h2>{late_chart}</section>"
        f"<section><h2>Coming up</h2>{due_chart}<p>{horizons}</p></section></div>"
        f"<p>{len(report.relays)} relay(s) and {len(report.workers)} worker(s) alive: "
        f"{link('/processes', 'details')}</p>")
    if request.partial:
        return Response(body=live)
    return Response(body=page("Overview", live, active="/", refresh=d.refresh,
                              banner=d.take_flash(request)))
