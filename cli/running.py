"""Running the relay and the worker as long-lived processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc

from duebox.db import check_tables
from duebox.errors import DatabaseError
from duebox.logs import CollapsedLog

if TYPE_CHECKING:
    from duebox import Duebox

T = TypeVar("T")
log = logging.getLogger("duebox.cli")

# How often a process waiting for its database at start asks again; it says
# so once per CollapsedLog interval (30 s), with a count.
_ASK_EVERY = 1.0


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[T]]) -> T | None:
    """Run ``main(stop)`` until SIGINT or SIGTERM sets ``stop``; what it
    returns (None when interrupted)."""

    async def runner() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    try:
        return asyncio.run(runner())
    except KeyboardInterrupt:
        click.echo("stopped", err=True)
        return None


async def database_ready(app: Duebox, action: str, stop: asyncio.Event) -> bool:
    """Whether the app's database answers, with duebox's tables: a relay or
    worker started while its database cannot be reached waits for it (one
    line per interval), as it rides out an outage once running; False if
    ``stop`` came first.  A database that answers without duebox's tables
    or a privilege, or a missing SQLite file, is raised at once: waiting
    would not mend it."""
    said = CollapsedLog(log)
    waited = False
    while not stop.is_set():
        try:
            await asyncio.to_thread(check_tables, app.engine, action)
        except DatabaseError as exc:
            if not await asyncio.to_thread(_unreachable, app.engine):
                raise
            said.warning("unreachable", "%s; waiting for it (asking every %g s)", exc,
                         _ASK_EVERY)
            waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _ASK_EVERY)
            continue
        if waited:
            log.info("%s: the database answers; starting", action)
        return True
    return False


def _unreachable(engine: Engine) -> bool:
    """Whether no connection to the database opens (a server that is down,
    starting, or out of reach; a file database is never down)."""
    if engine.dialect.name == "sqlite":  # connecting would create a missing file
        return False
    try:
        with engine.connect():
            return False
    except (sa_exc.OperationalError, sa_exc.InterfaceError):
        return True


def serve_metrics(port: int | None, host: str,
                  registry: CollectorRegistry | None = None) -> Any:
    """Serve ``/metrics`` on ``port`` (nothing when None): ``registry``, or
    this process's own metrics; the server, or None."""
    if port is None:
        return None
    from duebox.metrics import process_metrics, serve

    server = serve(registry or process_metrics(), port, host)
    click.echo(f"metrics on http://{host}:{server.server_port}/metrics", err=True)
    return server
