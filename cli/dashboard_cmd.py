"""``duebox dashboard``: serve the web dashboard (docs/dashboard.md).

cli/main.py adds it to the ``duebox`` group.
"""

from __future__ import annotations

import ipaddress

import click

from duebox import migrate

from .loading import load_app
from .options import FiniteRange, app_options


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


@click.command()
@app_options
@click.option("--host", envvar="DUEBOX_DASHBOARD_HOST", default="127.0.0.1",
              help="Address to listen on: IPv4 or IPv6 (::1), or a name. "
                   "[env DUEBOX_DASHBOARD_HOST]")
@click.option("--port", envvar="DUEBOX_DASHBOARD_PORT", type=click.IntRange(0, 65535),
              default=8377, help="Port (0: any free one). [env DUEBOX_DASHBOARD_PORT]")
@click.option("--token", envvar="DUEBOX_DASHBOARD_TOKEN", default=None, show_default=False,
              help="Operator token that allows replay, purge, pause and resume; without one "
                   "the dashboard is read-only.  Prefer the environment variable (a command "
                   "line is visible to other users). [env DUEBOX_DASHBOARD_TOKEN]")
@click.option("--refresh", envvar="DUEBOX_DASHBOARD_REFRESH", type=FiniteRange(0.5, 600),
              default=2.0, help="Seconds between auto-refreshes of the live pages. "
                                "[env DUEBOX_DASHBOARD_REFRESH]")
@click.option("--allow-host", "allow_hosts", multiple=True, envvar="DUEBOX_DASHBOARD_ALLOW_HOSTS",
              metavar="NAME",
              help="A name the dashboard answers for besides localhost and IP addresses (the "
                   "name people type, or the one your reverse proxy forwards); repeat for "
                   "more.  Other names get 421 (DNS rebinding). "
                   "[env DUEBOX_DASHBOARD_ALLOW_HOSTS, space-separated]")
@click.option("--show-unregistered-payloads", is_flag=True,
              envvar="DUEBOX_DASHBOARD_SHOW_UNREGISTERED_PAYLOADS",
              help="Show payloads of tasks the app does not register (their mask hooks are "
                   "unknown, so they are hidden by default).")
def dashboard(app_spec: str | None, database_url: str | None, broker_url: str | None,
              host: str, port: int, token: str | None, refresh: float,
              allow_hosts: tuple[str, ...], show_unregistered_payloads: bool) -> None:
    """Serve the web dashboard: overview, jobs, schedules, DLQ, relays and workers."""
    from duebox.dashboard import DashboardServer

    app = load_app(app_spec, database_url, broker_url)
    current = migrate.current_revision(app.engine)
    if current is not None and current != migrate.head_revision():
        click.echo(f"warning: the database is at revision {current}, this duebox expects "
                   f"{migrate.head_revision()}: run `duebox db upgrade`", err=True)
    try:
        server = DashboardServer(app, host=host, port=port, token=token or None,
                                 refresh=refresh, allow_hosts=allow_hosts,
                                 show_unregistered_payloads=show_unregistered_payloads)
    except OSError as exc:
        raise click.ClickException(f"--host/--port: cannot listen on {host} port {port}: "
                                   f"{exc}") from exc
    if not _loopback(server.server_address[0]) and token is None:
        click.echo(f"warning: serving on {host} without a token: anyone who can reach it "
                   "can read job payloads that no mask hook hides", err=True)
    mode = "read-only" if token is None else "actions allowed with the token"
    click.echo(f"duebox dashboard on {server.url} ({mode}); Ctrl-C stops it", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
