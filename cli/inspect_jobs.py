"""``duebox jobs list|show`` and ``duebox dlq show``: the read models of
:mod:`duebox.reads.jobs` as text.  Error text and tracebacks are masked like the
payload (:mod:`duebox.masking`)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from duebox import Duebox
from duebox.masking import Masked, masked
from duebox.reads.jobs import JobDetail, JobView, find_job, load_job, locator, where_now
from duebox.reads.results import loaded
from duebox.validation import shown


def _fmt(ts: datetime | None) -> str:
    return ts.isoformat(timespec="milliseconds") if ts else "-"


def list_line(r: JobView) -> str:
    due = r.due_at.isoformat(timespec="milliseconds")[:23]
    return (f"{r.id!s:<36}  {r.state:<11} {due:<23} {shown(r.task):<20} {r.attempt:>3} "
            f"{r.version:>3} {shown(r.key or '')}")


LIST_HEAD = f"{'id':<36}  {'state':<11} {'due (UTC)':<23} {'task':<20} att ver key"


def list_json(r: JobView) -> dict[str, Any]:
    return {"id": str(r.id), "task": r.task, "queue": r.queue, "state": r.state,
            "due_at": r.due_at.isoformat(), "attempt": r.attempt, "version": r.version,
            "key": r.key, "tenant": r.tenant, "error_class": r.error_class}


def _error(m: Masked, text: str | None) -> str:
    if not text:
        return ""
    out = m.text(text)
    return shown(out) if out is not None else f"({m.note})"


def _traceback(m: Masked, text: str | None, indent: str) -> list[str]:
    out = m.text(text) if text else None
    if out is None:
        return []
    # shown() per line: a traceback keeps its lines, never a control character.
    return [indent + shown(line) for line in out.splitlines()]


def render_job(app: Duebox, detail: JobDetail, now: datetime,
               show_unregistered: bool = False) -> str:
    row = detail.job
    m = masked(app, row.task, row.payload, show_unregistered=show_unregistered)
    lines = [
        f"job {row.id}",
        f"  task {shown(row.task)}  queue {shown(row.queue)}  state {row.state}  "
        f"version {row.version}  "
        f"attempt {row.attempt}/{row.max_attempts}",
    ]
    if row.key:
        lines.append(f"  key {shown(row.key)}")
    if row.tenant:
        lines.append(f"  tenant {shown(row.tenant)}  priority {row.priority}")
    lines.append(f"  now: {shown(where_now(row, locator(app), now))}")
    payload = (f"({m.note})" if m.hidden
               else json.dumps(m.payload, sort_keys=True)[:2000])
    lines.append(f"  payload {shown(payload)}")
    if detail.result_text is not None:
        # Masked like the payload (duebox.reads.results): always shown, it is short.
        kept = m.value(loaded(detail.result_text))
        result = f"({m.note})" if m.hidden else json.dumps(kept, sort_keys=True)[:2000]
        lines.append(f"  result {shown(result)}")
    if m.note and not m.hidden:  # a hidden payload's line says why already
        lines.append(f"  ({m.note})")
    lines.append("timeline")
    for e in detail.timeline():
        note = "" if e.late_s is None else f"  ({e.late_s * 1000:+.1f} ms vs due)"
        lines.append(f"  {e.name:<9} {_fmt(e.at)}{note}")
    if detail.attempts:
        lines.append("attempts")
        for a in detail.attempts:
            err = f"  {a.error_class}: {_error(m, a.error)}" if a.error_class else ""
            lines.append(f"  #{a.number} {a.outcome or 'running'} on {shown(a.worker or '-')} "
                         f"started {_fmt(a.started_at)} finished {_fmt(a.finished_at)}{err}")
            lines += _traceback(m, a.traceback, "      ")
    if row.last_error:
        lines.append(f"last error ({row.error_class}): {_error(m, row.last_error)}")
    if detail.audits:
        lines.append("audit")
        for au in detail.audits:
            lines.append(f"  {_fmt(au.at)} {shown(au.action)} by {shown(au.operator)}: "
                         f"{shown(au.reason)}")
    return "\n".join(lines)


def show_job(app: Duebox, ref: str, now: datetime, show_unregistered: bool = False) -> str:
    """``jobs show`` / ``dlq show``: the job ``ref`` names (id, key or id
    prefix), its payload masked; a task this app does not register has its
    payload hidden unless ``show_unregistered``."""
    return render_job(app, load_job(app.engine, find_job(app.engine, ref)), now,
                      show_unregistered)
