"""Job search and the job page: timeline, where it is now, versions, audit."""

from __future__ import annotations

from duebox.masking import Masked
from duebox.reads.jobs import AttemptView, JobDetail
from duebox.reads.results import loaded
from duebox.states import FINAL_STATES, JobState

from .context import Dashboard
from .reads import read_job, read_jobs, versions
from .render import (
    badge,
    compact_json,
    esc,
    link,
    page,
    payload_section,
    pre_json,
    seconds,
    table,
    ts,
)
from .web import REF, Request, Response, redirect, route, url


def _search_form(request: Request) -> str:
    def field(name: str, label: str, placeholder: str = "") -> str:
        return (f'<label>{esc(label)} <input name={name} value="{esc(request.query.get(name, ""))}"'
                f' placeholder="{esc(placeholder)}"></label>')

    chosen = request.query.get("state", "").upper()
    options = '<option value="">any</option>' + "".join(
        f'<option{" selected" if s == chosen else ""}>{esc(s)}</option>' for s in JobState)
    return (f'<form method=get action="{esc(url("/jobs"))}" class=search>'
            + field("q", "Id or key", "job id or business key") + field("queue", "Queue")
            + f"<label>State <select name=state>{options}</select></label>"
            + field("from", "Due from (UTC)", "2026-01-31T09:00")
            + field("to", "Due before", "2026-02-01") + "<button>Search</button></form>")


@route("GET", r"/jobs")
def jobs(d: Dashboard, request: Request) -> Response:
    found = read_jobs(d, request.query, d.page_size)
    f, result = found.filter, found.page
    if f.text and len(result.rows) == 1 and not request.partial:
        return redirect(f"/jobs/{result.rows[0].id}")
    rows = [[link(f"/jobs/{r.id}", str(r.id)[:13] + "…"), esc(r.task), esc(r.queue),
             esc(r.tenant or ""), badge(r.state), ts(r.due_at), esc(r.attempt), esc(r.version),
             esc(r.key or ""), esc(r.error_class or "")] for r in result.rows]
    listing = table(["id", "task", "queue", "tenant", "state", "due (UTC)", "att", "ver", "key",
                     "error"], rows, empty="no job matches")
    if result.next is not None:
        params = {k: v for k, v in request.query.items() if k != "after"}
        listing += f"<p>{link('/jobs', 'next page →', **params, after=result.next.encode())}</p>"
    return Response(body=page("Jobs", listing, _search_form(request), active="/jobs"))


def _error_text(m: Masked, text: str | None, limit: int | None = None) -> str:
    """Error text as it may be shown (masked like the payload), escaped."""
    shown = m.text(text)
    if text and shown is None:
        return f"<span class=muted>{esc(m.note)}</span>"
    return esc((shown or "")[:limit])


def _attempts(attempts: list[AttemptView], m: Masked) -> str:
    return table(["#", "outcome", "worker", "started", "finished", "took", "error class",
                  "error"],
                 [[esc(a.number), esc(a.outcome or "running"), esc(a.worker or ""),
                   ts(a.started_at), ts(a.finished_at),
                   seconds((a.finished_at - a.started_at).total_seconds())
                   if a.finished_at else "-",
                   esc(a.error_class or ""), f"<code>{_error_text(m, a.error, 300)}</code>"
                   + _traceback(m, a.traceback)]
                  for a in attempts], empty="no attempts yet")


def _traceback(m: Masked, text: str | None) -> str:
    """An attempt's traceback, folded (masked like its error text)."""
    if not text or m.text(text) is None:
        return ""
    return f"<details><summary>traceback</summary><pre>{_error_text(m, text)}</pre></details>"


def _versions(detail: JobDetail) -> str:
    items = [f"<li>v1 scheduled {ts(v.at)}</li>" if v.operator is None
             else f"<li>{esc(v.action)} {ts(v.at)} by {esc(v.operator)}</li>"
             for v in versions(detail)]
    return (f"<p>now version <b>{esc(detail.job.version)}</b></p>"
            f"<ol class=versions>{''.join(items)}</ol>")


@route("GET", rf"/jobs/{REF}")
def job(d: Dashboard, request: Request, job_id: str) -> Response:
    shown = read_job(d, job_id)
    detail, m = shown.detail, shown.mask
    row = detail.job
    events = table(["event", "at (UTC)", "vs due"],
                   [[esc(e.name), ts(e.at), "" if e.late_s is None else seconds(e.late_s)]
                    for e in detail.timeline()])
    facts = table(["task", "queue", "tenant", "state", "attempt", "version", "key", "priority"],
                  [[esc(row.task), link("/jobs", row.queue, queue=row.queue),
                    esc(row.tenant or ""), badge(row.state),
                    f"{row.attempt}/{row.max_attempts}", esc(row.version), esc(row.key or ""),
                    esc(row.priority)]])
    audit_rows = table(["at (UTC)", "action", "operator", "reason", "details"],
                       [[ts(a.at), esc(a.action), esc(a.operator), esc(a.reason),
                         f"<code>{compact_json(a.details)}</code>"] for a in detail.audits],
                       empty="no audit rows", cls="audit")
    error = (f'<h2>Last error</h2><p><b>{esc(row.error_class)}</b></p>'
             f"<pre>{_error_text(m, row.last_error)}</pre>" if row.last_error else "")
    live = (f"{facts}<p class=where><b>Where it is now:</b> "
            f"{esc(shown.where)}</p>"
            f"<h2>Timeline</h2>{events}<h2>Attempts</h2>{_attempts(detail.attempts, m)}{error}"
            f"<h2>Versions</h2>{_versions(detail)}<h2>Audit</h2>{audit_rows}")
    if request.partial:
        return Response(body=live)
    rest = payload_section(m.payload, m.note, m.hidden)
    if detail.result_text is not None and not m.hidden:  # masked like the payload
        rest += "<h2>Result</h2>" + pre_json(m.value(loaded(detail.result_text)))
    if row.state == JobState.DEAD:
        rest += ("<h2>Dead letter</h2>"
                 + d.action_form(request, f"/jobs/{row.id}/replay", "Replay")
                 + d.action_form(request, f"/jobs/{row.id}/purge", "Purge", danger=True))
    final = row.state in FINAL_STATES
    return Response(body=page(f"Job {row.id}", live, rest, active="/jobs",
                              refresh=None if final else d.refresh,
                              banner=d.take_flash(request)))
