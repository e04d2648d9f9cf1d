"""``duebox dlq list|show|replay|purge``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from duebox import dlq
from duebox.ids import parse_job_id
from duebox.masking import masked, shown_as_is
from duebox.reads.jobs import payloads
from duebox.validation import check_operator, shown

from .loading import load_app
from .options import TEXT, FiniteRange, app_options, operator_options, unregistered_payloads_option

Cmd = Callable[..., None]


def _ids(values: tuple[str, ...]) -> list[Any] | None:
    return [parse_job_id(v, "JOB_ID") for v in values] if values else None


# Filtering on a class that does not exist would match nothing and look like
# success ("replayed 0"): click refuses it, naming the valid ones.
ERROR_CLASS = click.Choice(dlq.ERROR_CLASSES)


@click.group("dlq")
def dlq_group() -> None:
    """The dead-letter queue: browse, replay, purge."""

@dlq_group.command("list")
@app_options
@click.option("--error-class", default=None, type=ERROR_CLASS)
@click.option("--task", default=None, type=TEXT)
@click.option("--limit", default=50, type=click.IntRange(1, 10_000))
def dlq_list(app_spec: str | None, database_url: str | None, broker_url: str | None,
             error_class: str | None, task: str | None, limit: int) -> None:
    """Dead jobs with their error class; quarantined ones are marked Q."""
    app = load_app(app_spec, database_url, broker_url)
    with app.engine.connect() as conn:
        total = dlq.count_dead(conn, error_class=error_class, task=task)
        rows = dlq.list_dead(conn, error_class=error_class, task=task, limit=limit)
        # Error text may quote the payload: masked like it (so read it).
        data = payloads(conn, [r.id for r in rows if not shown_as_is(app, r.task)])
    click.echo(f"{total} dead job(s)")
    for r in rows:
        text = r.last_error if r.id not in data else \
            masked(app, r.task, data[r.id]).text(r.last_error)
        err = shown(text.splitlines()[0][:70]) if text else \
            ("(hidden: give --app)" if r.last_error else "")
        click.echo(f"{'Q' if r.quarantined else ' '} {r.id}  {shown(r.task):<20} "
                   f"{shown(r.error_class or '-'):<10} att {r.attempt:>2}  {err}")

@dlq_group.command("show")
@app_options
@unregistered_payloads_option
@click.argument("job", type=TEXT)
def dlq_show(app_spec: str | None, database_url: str | None, broker_url: str | None,
             show_unregistered: bool, job: str) -> None:
    """A dead job's payload (masked), attempts with their tracebacks, and audit
    trail. JOB is its id, its key, or the start of its id."""
    from .inspect_jobs import show_job

    app = load_app(app_spec, database_url, broker_url)
    click.echo(show_job(app, job, app.clock.now(), show_unregistered))

def _operator_options(fn: Cmd) -> Cmd:
    fn = operator_options(fn)
    fn = click.option("--task", default=None, type=TEXT,
                      help="Only dead jobs of this task.")(fn)
    fn = click.option("--error-class", default=None, type=ERROR_CLASS,
                      help="Only this error class.")(fn)
    fn = click.option("--all", "all_dead", is_flag=True,
                      help="Every dead job (or every one matching the filters).")(fn)
    return click.argument("job_ids", nargs=-1)(fn)

@dlq_group.command("replay")
@app_options
@_operator_options
@click.option("--rate", default=50.0, type=FiniteRange(min=dlq.MIN_RATE),
              help="Replayed jobs become due at most this many per second.")
@click.option("--force", is_flag=True, help="Also replay quarantined jobs.")
def dlq_replay(app_spec: str | None, database_url: str | None, broker_url: str | None,
               job_ids: tuple[str, ...], all_dead: bool, error_class: str | None,
               task: str | None, operator: str, reason: str, rate: float,
               force: bool) -> None:
    """Send dead jobs back through dispatch (same job id, fresh attempts)."""
    operator, reason = check_operator(operator, reason)  # before any question
    app = load_app(app_spec, database_url, broker_url)
    ids = _select(job_ids, all_dead, error_class, task)
    with app.engine.connect() as conn:
        total = len(ids) if ids is not None else dlq.count_dead(
            conn, error_class=error_class, task=task)
    with click.progressbar(length=total, label="replaying") as bar:
        report = dlq.replay(app, operator=operator, reason=reason, ids=ids,
                            error_class=error_class, task=task, rate=rate, force=force,
                            progress=bar.update)
    click.echo(f"replayed {report.replayed}")
    for why, n in sorted(report.refused.items()):
        click.echo(f"refused {n}: {why}")
    if report.last_due_at is not None:
        click.echo(f"the last replayed job is due at {report.last_due_at.isoformat()}")

@dlq_group.command("purge")
@app_options
@_operator_options
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def dlq_purge(app_spec: str | None, database_url: str | None, broker_url: str | None,
              job_ids: tuple[str, ...], all_dead: bool, error_class: str | None,
              task: str | None, operator: str, reason: str, yes: bool) -> None:
    """Delete dead jobs and their attempts (audit rows stay)."""
    operator, reason = check_operator(operator, reason)  # before any question
    app = load_app(app_spec, database_url, broker_url)
    ids = _select(job_ids, all_dead, error_class, task)
    if not yes:
        click.confirm("Delete these dead jobs for good?", abort=True)
    with app.engine.connect() as conn:
        total = len(ids) if ids is not None else dlq.count_dead(
            conn, error_class=error_class, task=task)
    with click.progressbar(length=total, label="purging") as bar:
        n = dlq.purge(app, operator=operator, reason=reason, ids=ids,
                      error_class=error_class, task=task, progress=bar.update)
    click.echo(f"purged {n}")


def _select(job_ids: tuple[str, ...], all_dead: bool, error_class: str | None,
            task: str | None) -> list[Any] | None:
    if job_ids and (all_dead or error_class or task):
        raise click.UsageError("give job ids or --all/--error-class/--task, not both")
    if not job_ids and not (all_dead or error_class or task):
        raise click.UsageError("give job ids, or --all (optionally with --error-class/--task)")
    return _ids(job_ids)
