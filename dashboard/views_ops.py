"""Schedules, the dead-letter queue, and relays and workers."""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo

from duebox.metrics import seconds as elapsed
from duebox.reads.pages import ScheduleAction
from duebox.schedules.cron import Fire, load_zone

from .context import Dashboard
from .reads import (
    ERROR_CLASSES,
    next_fire,
    next_transition,
    read_dlq,
    read_processes,
    read_schedule,
    read_schedules,
)
from .render import (
    badge,
    compact_json,
    esc,
    link,
    page,
    payload_section,
    seconds,
    table,
    ts,
)
from .web import REF, Request, Response, route


def _local(at: datetime, zone: tzinfo) -> str:
    local = at.astimezone(zone)
    return f"{local:%Y-%m-%d %H:%M:%S} {esc(local.tzname() or '')}"


def _fires(fires: list[Fire], zone: tzinfo) -> str:
    """Next fire times, local and UTC; a fire DST moved or doubled is marked,
    and so is the first fire after the clocks change."""
    rows = []
    previous = None
    for f in fires:
        note = f.describe(zone)
        offset = f.at.astimezone(zone).utcoffset()
        if not note and previous is not None and offset != previous:
            note = "the clocks changed since the previous fire: same wall time, new UTC time"
        previous = offset
        mark = f'<span class=dst title="{esc(note)}">DST</span> {esc(note)}' if note else ""
        rows.append([_local(f.at, zone), ts(f.at), mark])
    return table(["local", "UTC", "daylight saving"], rows, empty="no further fire times")


@route("GET", r"/schedules")
def schedules(d: Dashboard, request: Request) -> Response:
    infos, nxt = read_schedules(d, request.query, d.page_size)
    rows = []
    for i in infos:
        zone = load_zone(i.timezone)
        fire = next_fire(d, i)
        first = (f"{_local(fire.at, zone)}<br>{ts(fire.at)}"
                 + (' <span class=dst>DST</span>' if fire.kind != "regular" else "")
                 if fire else "-")
        rows.append([link(f"/schedules/{i.id}", i.name), f"<code>{esc(i.cron)}</code>",
                     esc(i.timezone), esc(i.task), first,
                     badge("PAUSED" if i.paused else "ACTIVE")])
    body = table(["name", "cron", "zone", "task", "next fire", "state"], rows,
                 empty="no schedules")
    if nxt:
        body += f"<p>{link('/schedules', 'next page →', after=nxt)}</p>"
    return Response(body=page("Schedules", body, active="/schedules",
                              banner=d.take_flash(request)))


@route("GET", rf"/schedules/{REF}")
def schedule_page(d: Dashboard, request: Request, ref: str) -> Response:
    shown = read_schedule(d, ref)
    info, recent = shown.info, shown.recent
    zone = load_zone(info.timezone)
    facts = table(["rule", "zone", "task", "queue", "policies", "jitter", "state", "version",
                   "origin"],
                  [[f"<code>{esc(info.cron)}</code>", esc(info.timezone), esc(info.task),
                    esc(info.queue),
                    esc(f"misfire {info.misfire}, overlap {info.overlap}, gap {info.gap}, "
                        f"fold {info.fold}"),
                    esc(f"{info.jitter} s"), badge("PAUSED" if info.paused else "ACTIVE"),
                    esc(info.version),
                    esc("in code" if info.origin == "code" else "by hand")]])
    upcoming = ("<p class=muted>paused: nothing fires until resumed (then from the next fire "
                "time after that moment)</p>" if info.paused else "")
    change = next_transition(zone, d.now())
    if change is not None:
        before = (change - timedelta(seconds=1)).astimezone(zone).tzname()
        upcoming += (f"<p>Next daylight saving change in {esc(info.timezone)}: "
                     f"{ts(change)} ({esc(before)} → {esc(change.astimezone(zone).tzname())})"
                     "</p>")
    history = table(["nominal (local)", "due (UTC)", "state", "attempt", "job"],
                    [[_local(r.nominal_fire_at, zone), ts(r.due_at), badge(r.state),
                      esc(r.attempt), link(f"/jobs/{r.id}", str(r.id)[:13] + "…")]
                     for r in recent], empty="no occurrences yet")
    body = (f"{facts}<h2>Next fire times</h2>{upcoming}"
            f"{_fires(shown.fires, zone)}<h2>Latest occurrences</h2>{history}"
            f"{payload_section(shown.mask.payload, shown.mask.note, shown.mask.hidden)}"
            f"<h2>Operator actions</h2>{_schedule_audit(shown.actions)}")
    action = ("resume", "Resume") if info.paused else ("pause", "Pause")
    rest = d.action_form(request, f"/schedules/{info.id}/{action[0]}", action[1])
    return Response(body=page(f"Schedule {info.name}", body, rest, active="/schedules",
                              banner=d.take_flash(request)))


def _schedule_audit(actions: list[ScheduleAction]) -> str:
    return table(["at (UTC)", "action", "operator", "reason"],
                 [[ts(a.at), esc(a.action), esc(a.operator), esc(a.reason)] for a in actions],
                 empty="none recorded", cls="audit")


def _first_line(text: str | None) -> str:
    """The first line of a dead job's error (None: hidden by its mask)."""
    if text is None:
        return "<span class=muted>hidden (the job page says why)</span>"
    return esc(text.splitlines()[0][:120] if text else "")


@route("GET", r"/dlq")
def dead_letters(d: Dashboard, request: Request) -> Response:
    dead = read_dlq(d, request.query, d.page_size)
    error_class, task, total, rows = dead.error_class, dead.task, dead.total, dead.rows
    filters = " ".join(
        link("/dlq", c if c != error_class else f"[{c}]", error_class=c, task=task)
        for c in ERROR_CLASSES) + " " + link("/dlq", "all", task=task)
    listing = table(
        ["", "id", "task", "queue", "error class", "attempts", "died", "error"],
        [["Q" if r.quarantined else "", link(f"/jobs/{r.id}", str(r.id)[:13] + "…"),
          esc(r.task), esc(r.queue), esc(r.error_class or "-"), esc(r.attempt),
          ts(r.finished_at),
          f"<code>{_first_line(dead.errors[r.id])}</code>"] for r in rows],
        empty="the dead-letter queue is empty")
    if dead.after is not None:
        more = link("/dlq", "next page →", error_class=error_class, task=task,
                    after=str(dead.after))
        listing += f"<p>{more}</p>"
    scope_text = (f" of class {error_class}" if error_class else "") + \
        (f" of task {task}" if task else "")
    live = (f"<p><b>{total}</b> dead job(s){esc(scope_text)}. Q: quarantined (died the same "
            f"way after a replay).</p><p>Filter: {filters}</p>{listing}")
    scope = (f'<input type=hidden name=error_class value="{esc(error_class or "")}">'
             f'<input type=hidden name=task value="{esc(task or "")}">')
    rate = ('<label>Rate (jobs/s) <input name=rate type=number min=0.1 max=1000 step=any '
            'value=10></label>')
    rest = ""
    if total:
        rest = ("<h2>Replay or purge everything listed</h2>"
                + d.action_form(request, "/dlq/replay", f"Replay {total}", scope + rate)
                + d.action_form(request, "/dlq/purge", f"Purge {total}", scope, danger=True))
    return Response(body=page("Dead-letter queue", live, rest, active="/dlq",
                              banner=d.take_flash(request)))


@route("GET", r"/processes")
def processes(d: Dashboard, request: Request) -> Response:
    seen = read_processes(d)
    now, procs, leases, flying = seen.now, seen.alive, seen.leases, seen.leased
    rows = []
    for p in procs:
        info = p.info
        held = flying.get(p.name, {})
        rows.append([esc(p.role), f"<code>{esc(p.name)}</code>", esc(info.get("backend", "?")),
                     esc(f"{info.get('host', '?')} pid {info.get('pid', '?')}"),
                     seconds(elapsed(now, p.heartbeat_at)) if p.heartbeat_at else "-",
                     seconds((p.expires_at - now).total_seconds()),
                     esc(", ".join(f"{s} {n}" for s, n in sorted(held.items())) or "-"),
                     esc(", ".join(str(q) for q in info.get("queues", [])) or "")])
    lease_rows = [[f"<code>{esc(r.name)}</code>", esc(r.owner or "-"), esc(r.epoch),
                   ts(r.expires_at),
                   seconds((r.expires_at - now).total_seconds()) if r.expires_at else "-",
                   f"<code>{compact_json(r.info)}</code>"] for r in leases]
    live = (table(["role", "name", "backend", "where", "heartbeat age", "expires in",
                   "jobs leased", "queues"], rows, empty="no relay or worker is alive")
            + "<h2>Leases and shards</h2>"
            + table(["name", "owner", "epoch", "expires (UTC)", "expires in", "info"],
                    lease_rows, empty="no named leases"))
    if request.partial:
        return Response(body=live)
    return Response(body=page("Relays and workers", live, active="/processes",
                              refresh=d.refresh))
