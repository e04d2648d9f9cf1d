"""``duebox routes``: which broker serves each queue, and what the database
still has on a route that no longer serves its queue (docs/brokers.md,
"Switching a queue's broker")."""

from __future__ import annotations

import json

import click

from duebox import reroute
from duebox.validation import shown

from .loading import load_app
from .options import app_options


@click.command("routes")
@app_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
def routes(app_spec: str | None, database_url: str | None, broker_url: str | None,
           as_json: bool) -> None:
    """Each queue's broker, and jobs still handed to an old one.

    After a queue's route changes, a relay moves the jobs it finds on the old
    route to the new one when it starts and every minute after; until then
    they are listed here.  Exits 1 while any are left."""
    app = load_app(app_spec, database_url, broker_url)
    table = app.routes
    with app.engine.connect() as conn:
        left = reroute.leftovers(conn, table)
        counts = reroute.enqueued_by_route(conn)
    queues = sorted({*app.queues, *table.routed, *(q for q, _ in counts)})
    if as_json:
        click.echo(json.dumps({
            "routes": {q: reroute.route_key(table.url_for(q)) for q in queues},
            "leftovers": [{"queue": x.queue, "published_to": x.published_to,
                           "route_now": x.route_now, "jobs": x.jobs,
                           "earliest_due": x.earliest.isoformat() if x.earliest else None}
                          for x in left]}))
    else:
        click.echo(f"{'QUEUE':<24} {'ENQUEUED':>8}  BROKER")
        for q in queues:
            here = sum(n for (queue, _), n in counts.items() if queue == q)
            click.echo(f"{shown(q)[:24]:<24} {here:>8}  {reroute.route_key(table.url_for(q))}")
        if not left:
            click.echo("nothing left on an old route")
        for x in left:
            due = f", the earliest due {x.earliest:%Y-%m-%d %H:%M:%S}" if x.earliest else ""
            click.echo(f"{x.jobs} job(s) of queue {shown(x.queue)} still on {x.published_to} "
                       f"(now {x.route_now}){due}: a relay moves them when it starts and "
                       "every minute")
    if left:
        raise SystemExit(1)
