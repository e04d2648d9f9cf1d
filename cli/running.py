"""Running the relay and the worker as long-lived processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click
from prometheus_client import CollectorRegistry

from duebox.brokers.base import Broker, open_broker
from duebox.db import check_tables
from duebox.errors import AccessRefusedError, DatabaseError
from duebox.observability.trouble import TROUBLES, cause_of

if TYPE_CHECKING:
    from duebox import Duebox

T = TypeVar("T")
log = logging.getLogger("duebox.cli")

# How often a process waiting for its database at start asks again; it says
# so once per interval of duebox.observability.trouble (30 s), with a count.
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
    line per interval, duebox.observability.trouble), as it rides out an outage once
    running; False if ``stop`` came first.  A database that answers without
    duebox's tables or a privilege, or a missing SQLite file, is raised at
    once: waiting would not mend it.  One that refuses the connection (a
    wrong password, an unknown database or role) is asked again through the
    grace of duebox.observability.trouble, then raised as AccessRefusedError."""
    waited = False
    while not stop.is_set():
        try:
            await asyncio.to_thread(check_tables, app.engine, action)
        except DatabaseError as exc:
            cause = cause_of(exc)
            if cause is None:
                raise
            TROUBLES.report(cause, log, action, stops=True,
                            then=f"waiting for it (asking every {_ASK_EVERY:g} s)")
            if TROUBLES.final(cause):
                raise AccessRefusedError(TROUBLES.ended(cause)) from exc
            waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _ASK_EVERY)
            continue
        if waited:
            log.info("%s: the database answers; starting", action)
        return True
    return False


async def brokers_accept(brokers: Sequence[Broker], stop: asyncio.Event) -> None:
    """Before a relay or a supervisor of workers says it started: raise
    AccessRefusedError when a broker keeps refusing the connection (a wrong
    login or vhost) through the grace, so the command ends with that one
    line.  A broker out of reach is left to the processes, which retry."""
    for broker in brokers:
        if await open_broker(broker, stop, refusals_only=True):
            await broker.close()


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
