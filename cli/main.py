"""``duebox`` — relay, worker, database, jobs, status and the demo.

Every option has a ``DUEBOX_*`` environment variable: the shared ones are
named in ``--help`` (``DUEBOX_APP``, ``DUEBOX_DATABASE_URL`` ...); the rest
follow click's ``DUEBOX_<COMMAND>_<OPTION>`` rule, e.g.
``DUEBOX_JOBS_LIST_LIMIT`` or ``DUEBOX_DEMO_JOBS``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import click
from sqlalchemy.orm import Session

from duebox import Duebox, DueboxError, migrate
from duebox.credentials import redacted
from duebox.ids import parse_job_id
from duebox.reads.status import DUE_WITHIN
from duebox.states import JobState
from duebox.validation import MAX_SPAN

from .dashboard_cmd import dashboard
from .dlq_cmd import dlq_group
from .loading import load_app
from .options import (
    TEXT,
    F,
    FiniteRange,
    app_options,
    errors_as_messages,
    operator_options,
    unregistered_payloads_option,
)
from .processes import cpu_count, processes_option, run_processes
from .routes_cmd import routes
from .schedules_cmd import schedules


@click.group(context_settings={"auto_envvar_prefix": "DUEBOX", "show_default": True})
@click.option("--log-level", envvar="DUEBOX_LOG_LEVEL", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="[env DUEBOX_LOG_LEVEL]")
@click.option("--log-format", envvar="DUEBOX_LOG_FORMAT", default="text", show_default=True,
              type=click.Choice(["text", "json"], case_sensitive=False),
              help="json: one JSON object per line. [env DUEBOX_LOG_FORMAT]")
@click.version_option(package_name="duebox")
def cli(log_level: str, log_format: str) -> None:
    """duebox: durable delayed dispatch on the broker you already run."""
    from duebox.observability.logformat import configure

    configure(log_level, log_format.lower())


def metrics_options(fn: F) -> F:
    """--metrics-port and --metrics-host for the long-running commands."""
    fn = click.option("--metrics-host", envvar="DUEBOX_METRICS_HOST", default="127.0.0.1",
                      help="Address the metrics endpoint listens on. "
                           "[env DUEBOX_METRICS_HOST]")(fn)
    return click.option("--metrics-port", envvar="DUEBOX_METRICS_PORT",
                        type=click.IntRange(0, 65535), default=None,
                        help="Serve Prometheus metrics on this port (off when unset). "
                             "[env DUEBOX_METRICS_PORT]")(fn)


@cli.command()
@app_options
@metrics_options
@click.option("--batch-size", envvar="DUEBOX_BATCH_SIZE", type=int, default=None,
              help="Jobs per claim. [env DUEBOX_BATCH_SIZE]")
@click.option("--poll-interval", envvar="DUEBOX_POLL_INTERVAL", type=float, default=None,
              help="Longest sleep between passes, seconds. [env DUEBOX_POLL_INTERVAL]")
def relay(app_spec: str | None, database_url: str | None, broker_url: str | None,
          metrics_port: int | None, metrics_host: str,
          batch_size: int | None, poll_interval: float | None) -> None:
    """Claim due jobs and hand them to the broker."""
    from duebox.relay import Relay

    from .running import brokers_accept, database_ready, run_until_signalled, serve_metrics

    app = load_app(app_spec, database_url, broker_url, tables=False)  # waited for below
    app.configure(batch_size=batch_size, poll_interval=poll_interval)
    r = Relay(app)  # it logs one line when it starts and one when it stops
    serve_metrics(metrics_port, metrics_host)

    async def main(stop: asyncio.Event) -> None:
        if await database_ready(app, "relay", stop):
            # A refused login ends the command with one line, before "started".
            await brokers_accept([p.broker for p in r.pipelines], stop)
            await r.run(stop)

    run_until_signalled(main)


@cli.command()
@app_options
@metrics_options
@click.option("--concurrency", envvar="DUEBOX_CONCURRENCY", type=click.IntRange(1, 10_000),
              default=None,
              help="Jobs run at once. [env DUEBOX_CONCURRENCY]")
@click.option("--group-commit", envvar="DUEBOX_GROUP_COMMIT", type=click.IntRange(1, 1_000),
              default=None,
              help="Most short jobs run in one transaction under a backlog, each in its own "
                   "savepoint; 1 turns it off. [env DUEBOX_GROUP_COMMIT, default 32]")
@click.option("--queue", "queues", envvar="DUEBOX_QUEUES", multiple=True,
              help="Queue to consume (repeatable; default: every registered task's queue). "
                   "[env DUEBOX_QUEUES, space-separated]")
@click.option("--log-jobs/--no-log-jobs", envvar="DUEBOX_LOG_JOBS", default=None,
              help="One log line per finished job (logger duebox.jobs, INFO): task, id, "
                   "attempt, run time, start lateness, outcome. [env DUEBOX_LOG_JOBS, "
                   "default off]")
@processes_option
def worker(app_spec: str | None, database_url: str | None, broker_url: str | None,
           metrics_port: int | None, metrics_host: str,
           concurrency: int | None, group_commit: int | None,
           queues: tuple[str, ...], log_jobs: bool | None, processes: int | None) -> None:
    """Run handlers for delivered jobs: one worker process per CPU by default
    (docs/worker.md, "How many worker processes")."""
    from duebox.consumers import Worker

    from .running import brokers_accept, database_ready, run_until_signalled, serve_metrics

    app = load_app(app_spec, database_url, broker_url, tables=False)  # waited for below
    if not app.tasks:
        raise click.UsageError("--app: the app registers no tasks; a worker would do nothing")
    app.configure(log_jobs=log_jobs)
    w = Worker(app, queues=list(queues) or None, concurrency=concurrency,
               group_commit=group_commit)  # one line when it starts, one when it stops
    count = processes or cpu_count()
    if count > 1:
        # The app, its tables, the broker's login and the options are checked
        # here, once; each child builds its own worker from them.
        async def ready(stop: asyncio.Event) -> bool:
            if not await database_ready(app, "worker", stop):
                return False
            await brokers_accept([w.broker], stop)
            return not stop.is_set()

        if not run_until_signalled(ready):
            return
        app.dispose()
        options = {**click.get_current_context().find_root().params, "app_spec": app_spec,
                   "database_url": database_url, "broker_url": broker_url,
                   "concurrency": concurrency, "group_commit": group_commit,
                   "queues": queues, "log_jobs": app.settings.log_jobs}
        run_processes(count, options, metrics_port, metrics_host)
        return
    serve_metrics(metrics_port, metrics_host)

    async def main(stop: asyncio.Event) -> None:
        if await database_ready(app, "worker", stop):
            await w.run(stop)

    run_until_signalled(main)


@cli.group()
def db() -> None:
    """Create or upgrade duebox's tables."""


@db.command("upgrade")
@app_options
def db_upgrade(app_spec: str | None, database_url: str | None, broker_url: str | None) -> None:
    """Create or upgrade the tables to the newest revision."""
    logging.getLogger("alembic").setLevel(logging.INFO)  # each revision it runs
    app = load_app(app_spec, database_url, broker_url, tables=False)
    migrate.upgrade(app.engine)
    click.echo(f"database at revision {migrate.current_revision(app.engine)}")


@db.command("current")
@app_options
def db_current(app_spec: str | None, database_url: str | None, broker_url: str | None) -> None:
    """Print the database's revision and the newest one."""
    from duebox.db import missing_sqlite_file

    app = load_app(app_spec, database_url, broker_url, tables=False)
    missing = missing_sqlite_file(app.settings.database_url)  # not created by asking
    current = None if missing else migrate.current_revision(app.engine)
    click.echo(f"current {current}  head {migrate.head_revision()}"
               + (f"  (no database file at {missing})" if missing else ""))


@cli.group()
def jobs() -> None:
    """List, inspect and cancel jobs."""


@jobs.command("list")
@app_options
@click.option("--state", default=None, help="Only jobs in this state.",
              type=click.Choice([s.value for s in JobState], case_sensitive=False))
@click.option("--queue", default=None, type=TEXT, help="Only jobs of this queue.")
@click.option("--task", default=None, type=TEXT, help="Only jobs of this task.")
@click.option("--key", "key_prefix", default=None, type=TEXT,
              help="Only jobs whose business key starts with this.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def jobs_list(app_spec: str | None, database_url: str | None, broker_url: str | None,
              state: str | None, queue: str | None, task: str | None, key_prefix: str | None,
              limit: int, as_json: bool) -> None:
    """The latest jobs by due time."""
    from duebox.reads.jobs import JobFilter, list_jobs

    from .inspect_jobs import LIST_HEAD, list_json, list_line

    app = load_app(app_spec, database_url, broker_url)
    rows = list_jobs(app.engine, JobFilter(state, queue, task, key_prefix, limit))
    if as_json:
        for r in rows:
            click.echo(json.dumps(list_json(r), sort_keys=True))
        return
    click.echo(LIST_HEAD)
    for r in rows:
        click.echo(list_line(r))


@jobs.command("show")
@app_options
@unregistered_payloads_option
@click.argument("job", type=TEXT)
def jobs_show(app_spec: str | None, database_url: str | None, broker_url: str | None,
              show_unregistered: bool, job: str) -> None:
    """A job's payload (masked), timeline, attempts, audit rows and where it
    is now.

    JOB is its id, its business key, or the start of its id as `jobs list`
    prints it."""
    from .inspect_jobs import show_job

    app = load_app(app_spec, database_url, broker_url)
    click.echo(show_job(app, job, app.clock.now(), show_unregistered))


@jobs.command("cancel")
@app_options
@click.argument("job_id")
@operator_options
def jobs_cancel(app_spec: str | None, database_url: str | None, broker_url: str | None,
                job_id: str, operator: str, reason: str) -> None:
    """Cancel a job; a message already in a broker for it will be discarded."""
    app = load_app(app_spec, database_url, broker_url)
    jid = parse_job_id(job_id, "JOB_ID")
    with Session(app.engine) as session, session.begin():
        done = app.cancel(session, jid, operator=operator, reason=reason)
    click.echo(f"job {jid}: {'cancelled' if done else 'already finished, nothing to cancel'}")


@cli.command()
@app_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", type=FiniteRange(0.05, 86_400), is_flag=False, flag_value=2.0,
              default=None, metavar="[SECONDS]",
              help="Refresh every SECONDS (default 2) until interrupted.")
@click.option("--iterations", type=click.IntRange(min=1), default=None,
              help="With --watch: stop after this many refreshes.")
@click.option("--window", type=FiniteRange(1, MAX_SPAN.total_seconds()), default=300.0,
              help="Start lateness over jobs started in the last WINDOW seconds.")
@click.option("--max-due-age", type=FiniteRange(0, MAX_SPAN.total_seconds()), default=60.0,
              help="An oldest due job older than this is a problem.")
@click.option("--due-within", type=FiniteRange(0, MAX_SPAN.total_seconds()), default=DUE_WITHIN,
              help="A missing relay or worker is a problem when a job is in flight or due "
                   "within this many seconds; with work due only later, a warning.")
@click.option("--degraded-ok", is_flag=True,
              help="Exit 0 when degraded (warnings only), e.g. for a liveness probe.")
def status(app_spec: str | None, database_url: str | None, broker_url: str | None,
           as_json: bool, watch: float | None, iterations: int | None, window: float,
           max_due_age: float, due_within: float, degraded_ok: bool) -> None:
    """Is it healthy? Backlog, in flight, DLQ, lateness and live processes.

    Exit status (for probes and cron alerts): 0 healthy, 3 degraded (warnings
    only), 4 unhealthy, 1 when the status could not be read (no database, no
    tables), 2 on a usage error. With --watch, the last report's."""
    import time

    from duebox.reads.status import Verdict, build_report

    from .status_view import render

    app = load_app(app_spec, database_url, broker_url)
    shown = 0
    while True:
        report = build_report(app.engine, app.clock.now(), window=window,
                              max_due_age=max_due_age, own_queues=app.settings.own_queues,
                              due_within=due_within)
        if watch is not None and not as_json:
            click.clear()
        click.echo(json.dumps(report.as_json(), indent=2, sort_keys=True) if as_json
                   else render(report))
        shown += 1
        if watch is None or (iterations is not None and shown >= iterations):
            break
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            break
    ok = report.verdict is Verdict.HEALTHY or (degraded_ok and report.verdict is Verdict.DEGRADED)
    click.get_current_context().exit(0 if ok else report.verdict.exit_code)


@cli.command()
@click.option("--database-url", envvar="DUEBOX_DATABASE_URL", default="sqlite:///duebox.db",
              show_default=True, help="[env DUEBOX_DATABASE_URL]")
@click.option("--broker-url", envvar="DUEBOX_BROKER_URL", default="sql://", show_default=True,
              help="[env DUEBOX_BROKER_URL]")
@click.option("--jobs", "n_jobs", default=300, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--spread", default=5.0, show_default=True, type=FiniteRange(0, 60),
              help="Due times are spread evenly over SPREAD seconds, after a "
              "short lead in which the relay and the worker start.")
@click.option("--cancels", default=10, show_default=True, type=click.IntRange(0, 1000),
              help="How many of the jobs to cancel before they are due.")
@errors_as_messages
def demo(database_url: str, broker_url: str, n_jobs: int, spread: float, cancels: int) -> None:
    """Schedule jobs, run a relay and a worker, and report lateness and duplicates."""
    from .demo import START_LEAD, run_demo

    logging.getLogger().setLevel(logging.WARNING)
    app = Duebox(database_url=database_url, broker_url=broker_url)
    click.echo(f"duebox demo: {n_jobs} jobs due from {START_LEAD:g} s to "
               f"{START_LEAD + spread:g} s from now on {redacted(database_url)} "
               f"with {redacted(broker_url)}")
    r = run_demo(app, n_jobs, spread, cancels)
    app.dispose()
    click.echo(
        f"\nscheduled {r.scheduled}, cancelled {min(cancels, n_jobs)}, ran {r.ran}\n"
        f"ran before due time: {r.early}\n"
        f"ran twice: {r.duplicates}\n"
        f"cancelled but ran: {r.cancelled_ran}\n"
        f"lateness (start - due): p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms, "
        f"max {r.max_ms:.1f} ms\n"
        f"took {r.seconds:.1f} s"
    )
    expected = r.scheduled - min(cancels, n_jobs)
    if r.early or r.duplicates or r.cancelled_ran or r.ran != expected:
        raise click.ClickException("demo found a violated guarantee (see above)")
    click.echo("all guarantees held. Next: `duebox jobs list`, `duebox status`, "
               "`duebox dashboard`.")


@cli.group()
def broker() -> None:
    """The broker's side of your queues (docs/own-consumers.md)."""


@broker.command("declare")
@app_options
@click.option("--queue", "queues", multiple=True, type=TEXT,
              help="A queue to declare (repeat for several); default: DUEBOX_OWN_CONSUMER_QUEUES, "
                   "else every task's queue.")
def broker_declare(app_spec: str | None, database_url: str | None, broker_url: str | None,
                   queues: tuple[str, ...]) -> None:
    """Create queues, topics or streams now, before the relay's first publish,
    so a consumer of your own started first finds them; prints each queue's
    broker name."""
    app = load_app(app_spec, database_url, broker_url, tables=False)  # the broker only
    for queue, name in app.declare_broker(list(queues) or None).items():
        click.echo(f"{queue}\t{name}")


@broker.command("names")
@app_options
@click.option("--queue", "queues", multiple=True, type=TEXT,
              help="A queue (repeat for several); default as for declare.")
def broker_names(app_spec: str | None, database_url: str | None, broker_url: str | None,
                 queues: tuple[str, ...]) -> None:
    """Print each queue's name on the broker (no connection)."""
    app = load_app(app_spec, database_url, broker_url, tables=False)
    for queue in list(queues) or list(app.settings.own_queues) or app.queues:
        click.echo(f"{queue}\t{app.broker_queue_name(queue)}")


# The command groups defined in their own modules.
cli.add_command(dashboard)
cli.add_command(dlq_group)
cli.add_command(schedules)
cli.add_command(routes)


def main() -> None:
    try:
        cli(prog_name="duebox")
    except DueboxError as exc:  # pragma: no cover - commands convert their own
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
