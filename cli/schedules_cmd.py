"""``duebox schedules``: add, list, show, pause, resume, delete and preview
recurring schedules (see docs/schedules.md).

Registered on the ``duebox`` group by one import at the end of cli/main.py.
"""

from __future__ import annotations

import json
from datetime import datetime, tzinfo
from typing import Any

import click
from sqlalchemy.orm import Session

from duebox.schedules.api import (
    DEFAULT_MISFIRE,
    DEFAULT_OVERLAP,
    MISFIRE_POLICIES,
    OVERLAP_POLICIES,
    DeleteResult,
    PutResult,
    ScheduleInfo,
)
from duebox.schedules.cron import (
    DEFAULT_FOLD,
    DEFAULT_GAP,
    FOLD_POLICIES,
    GAP_POLICIES,
    Fire,
    load_zone,
)
from duebox.validation import shown

from .loading import load_app
from .options import TEXT, app_options, operator_options


def _local(at: datetime, zone: tzinfo) -> str:
    local = at.astimezone(zone)
    offset = local.strftime("%z")
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or ''} ({offset[:3]}:{offset[3:]})"


def _utc(at: datetime) -> str:
    return f"{at:%Y-%m-%dT%H:%M:%SZ}"


def _fire_line(fire: Fire, zone: tzinfo) -> str:
    note = fire.describe(zone)
    return f"  {_local(fire.at, zone):<36} {_utc(fire.at)}" + (f"   {note}" if note else "")


def _json(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"must be JSON ({exc})") from None


@click.group()
def schedules() -> None:
    """Recurring schedules: cron rules in a time zone that generate jobs."""


@schedules.command("add")
@app_options
@click.argument("name")
@click.argument("task")
@click.argument("cron")
@click.option("--tz", "--timezone", "timezone", default="UTC", show_default=True,
              help="IANA time zone the rule is evaluated in, e.g. Europe/Berlin.")
@click.option("--payload", callback=_json, default=None, help="JSON payload of each occurrence.")
@click.option("--queue", default=None, help="Queue (default: the task's).")
@click.option("--jitter", default=0, show_default=True, type=click.IntRange(0, 86_400),
              help="Delay each occurrence by a fixed pseudo-random 0..N seconds.")
@click.option("--misfire", type=click.Choice(MISFIRE_POLICIES), default=DEFAULT_MISFIRE,
              show_default=True, help="Fire times missed during an outage.")
@click.option("--overlap", type=click.Choice(OVERLAP_POLICIES), default=DEFAULT_OVERLAP,
              show_default=True, help="When the previous occurrence is still active.")
@click.option("--gap", type=click.Choice(GAP_POLICIES), default=DEFAULT_GAP, show_default=True,
              help="A wall time skipped by a DST change (spring forward).")
@click.option("--fold", type=click.Choice(FOLD_POLICIES), default=DEFAULT_FOLD,
              show_default=True, help="A wall time repeated by a DST change (fall back).")
@click.option("--priority", default=0, show_default=True, type=int)
@click.option("--expire-after", default=None, type=click.IntRange(1),
              help="Seconds after its due time an occurrence expires instead of running.")
@click.option("--paused", is_flag=True, help="Create it paused.")
@click.option("--update", is_flag=True,
              help="Create it, or make an existing NAME match these options (its version "
                   "goes up only when something changed; a pause stays as it is).")
@click.option("--operator", envvar="DUEBOX_OPERATOR", default=None, type=TEXT,
              help="With --update: who, for the audit row of a change. [env DUEBOX_OPERATOR]")
@click.option("--reason", default=None, type=TEXT,
              help="With --update: why, for the audit row of a change.")
def schedules_add(app_spec: str | None, database_url: str | None, broker_url: str | None,
                  name: str, task: str, cron: str, update: bool, operator: str | None,
                  reason: str | None, **options: Any) -> None:
    """Add schedule NAME running TASK on CRON (5 fields, or 6 with seconds first);
    with --update, add or update it (what a deploy script runs every time)."""
    if not update and (operator is not None or reason is not None):
        raise click.UsageError("--operator and --reason go with --update (adding a new "
                               "schedule writes no audit row)")
    app = load_app(app_spec, database_url, broker_url)
    with Session(app.engine) as session, session.begin():
        if update:
            done = app.schedules.put(session, name, task, cron, operator=operator,
                                     reason=reason, **options)
            assert isinstance(done, PutResult)
            sid = done.id
        else:
            sid = app.schedules.add(session, name, task, cron, **options)
        info = app.schedules.get(session, str(sid))
    assert isinstance(info, ScheduleInfo)
    if not update or done.outcome == "created":
        click.echo(f"schedule {shown(name)} {sid} added: {info.cron!r} in {info.timezone}")
    elif done.outcome == "updated":
        click.echo(f"schedule {shown(name)} {sid} updated to version {done.version} "
                   f"({', '.join(done.changed)}): {info.cron!r} in {info.timezone}")
    else:
        click.echo(f"schedule {shown(name)} {sid} unchanged: {info.cron!r} in "
                   f"{info.timezone}, version {done.version}")
    _echo_next(app.schedules.next_fires(info, 3), info)


@schedules.command("list")
@app_options
def schedules_list(app_spec: str | None, database_url: str | None,
                   broker_url: str | None) -> None:
    """Every schedule with its rule and next fire time."""
    app = load_app(app_spec, database_url, broker_url)
    with Session(app.engine) as session:
        infos = app.schedules.list(session)
    assert isinstance(infos, list)
    if not infos:
        click.echo("no schedules")
        return
    click.echo(f"{'name':<24} {'cron':<18} {'zone':<20} {'next fire (UTC)':<21} {'state':<7} "
               f"{'origin':<6} id")
    for i in infos:
        nxt = _utc(i.next_fire_at) if i.next_fire_at and not i.paused else "-"
        click.echo(f"{shown(i.name):<24} {i.cron:<18} {i.timezone:<20} {nxt:<21} "
                   f"{'paused' if i.paused else 'active':<7} {i.origin:<6} {i.id}")


@schedules.command("show")
@app_options
@click.argument("schedule")
@click.option("-n", "count", default=5, show_default=True, type=click.IntRange(0, 1000),
              help="How many next fire times and recent occurrences to show.")
def schedules_show(app_spec: str | None, database_url: str | None, broker_url: str | None,
                   schedule: str, count: int) -> None:
    """A schedule's settings, next fire times and latest occurrences."""
    app = load_app(app_spec, database_url, broker_url)
    with Session(app.engine) as session:
        info = app.schedules.get(session, schedule)
        assert isinstance(info, ScheduleInfo)
        recent = app.schedules.history(session, info.id, count) if count else []
    assert isinstance(recent, list)
    zone = load_zone(info.timezone)
    last = _utc(info.last_fire_at) if info.last_fire_at else "-"
    click.echo(
        f"schedule {shown(info.name)} {info.id}\n"
        f"  rule      {info.cron!r} in {info.timezone}\n"
        f"  task      {shown(info.task)} on queue {shown(info.queue)}, priority {info.priority}, "
        f"max attempts {info.max_attempts}\n"
        f"  payload   {json.dumps(info.payload)}\n"
        f"  policies  misfire {info.misfire}, overlap {info.overlap}, gap {info.gap}, "
        f"fold {info.fold}\n"
        f"  jitter    {info.jitter} s; expire after "
        f"{f'{info.expire_after} s' if info.expire_after else 'never'}\n"
        f"  paused    {'yes' if info.paused else 'no'}   version {info.version}"
        f"{_retired(info)}\n"
        f"  origin    {_ORIGINS.get(info.origin, info.origin)}\n"
        f"  cursor    next fire {_utc(info.next_fire_at) if info.next_fire_at else '-'}, "
        f"last generated {last}"
    )
    if count:
        _echo_next(app.schedules.next_fires(info, count), info)
        click.echo("latest occurrences:" if recent else "no occurrences yet")
        for r in recent:
            click.echo(f"  {_local(r.nominal_fire_at, zone):<36} due {_utc(r.due_at)}  "
                       f"{r.state:<11} attempt {r.attempt}  {r.id}")


@schedules.command("pause")
@app_options
@click.argument("schedule")
@operator_options
def schedules_pause(app_spec: str | None, database_url: str | None, broker_url: str | None,
                    schedule: str, operator: str, reason: str) -> None:
    """Stop generating occurrences (those already generated still run)."""
    app = load_app(app_spec, database_url, broker_url)
    with Session(app.engine) as session, session.begin():
        changed = app.schedules.pause(session, schedule, operator=operator, reason=reason)
    click.echo(f"schedule {shown(schedule)}: {'paused' if changed else 'was already paused'}")


@schedules.command("resume")
@app_options
@click.argument("schedule")
@operator_options
def schedules_resume(app_spec: str | None, database_url: str | None, broker_url: str | None,
                     schedule: str, operator: str, reason: str) -> None:
    """Generate again from the next fire time after now (nothing from the pause)."""
    app = load_app(app_spec, database_url, broker_url)
    with Session(app.engine) as session, session.begin():
        nxt = app.schedules.resume(session, schedule, operator=operator, reason=reason)
    shown_next = _utc(nxt) if isinstance(nxt, datetime) else "none"
    click.echo(f"schedule {shown(schedule)}: active, next fire {shown_next}")


@schedules.command("delete")
@app_options
@click.argument("schedule")
@operator_options
@click.option("--cancel-pending/--keep-pending", default=False, show_default=True,
              help="Cancel the occurrences it already generated that have not started "
                   "(each gets an audit row), or keep them: they still run.")
def schedules_delete(app_spec: str | None, database_url: str | None, broker_url: str | None,
                     schedule: str, operator: str, reason: str, cancel_pending: bool) -> None:
    """Delete a schedule; say what happens to its pending occurrences."""
    app = load_app(app_spec, database_url, broker_url)
    with Session(app.engine) as session, session.begin():
        done = app.schedules.delete(session, schedule, cancel_pending=cancel_pending,
                                    operator=operator, reason=reason)
    assert isinstance(done, DeleteResult)
    if cancel_pending:
        what = f"{done.cancelled} pending occurrence(s) cancelled"
    elif done.kept:
        what = (f"{done.kept} pending occurrence(s) kept: they still run (`duebox jobs cancel` "
                "stops one; --cancel-pending cancels them with the schedule)")
    else:
        what = "no pending occurrences"
    click.echo(f"schedule {shown(schedule)}: deleted; {what}")


@schedules.command("next")
@app_options
@click.argument("schedule")
@click.option("-n", "count", default=10, show_default=True, type=click.IntRange(1, 10_000),
              help="How many fire times.")
@click.option("--after", default=None, metavar="ISO-8601",
              help="Start after this time instead of now, e.g. 2026-03-28 (without an "
                   "offset it is read in the schedule's zone).")
def schedules_next(app_spec: str | None, database_url: str | None, broker_url: str | None,
                   schedule: str, count: int, after: str | None) -> None:
    """The next fire times, in the schedule's zone and in UTC, with DST notes."""
    app = load_app(app_spec, database_url, broker_url)
    with Session(app.engine) as session:
        info = app.schedules.get(session, schedule)
    assert isinstance(info, ScheduleInfo)
    start = None
    if after is not None:
        try:
            start = datetime.fromisoformat(after)
        except ValueError:
            raise click.BadParameter("must be an ISO 8601 date or time",
                                     param_hint="--after") from None
        if start.tzinfo is None:
            start = start.replace(tzinfo=load_zone(info.timezone))
    click.echo(f"schedule {shown(info.name)}: {info.cron!r} in {info.timezone} "
               f"(gap {info.gap}, fold {info.fold}"
               + (f", +0..{info.jitter} s jitter" if info.jitter else "") + ")")
    _echo_next(app.schedules.next_fires(info, count, after=start), info)


_ORIGINS = {"api": "made by hand (CLI or app.schedules)",
            "code": "declared in code (@app.task(schedule=...)), synced by relays"}


def _retired(info: ScheduleInfo) -> str:
    if info.retired_at is None:
        return ""
    return f" (paused by a relay's sync: no longer declared in code since {_utc(info.retired_at)})"


def _echo_next(fires: list[Fire], info: ScheduleInfo) -> None:
    zone = load_zone(info.timezone)
    click.echo(f"next fire times ({info.timezone} / UTC):" if fires else "no further fire times")
    for f in fires:
        click.echo(_fire_line(f, zone))
