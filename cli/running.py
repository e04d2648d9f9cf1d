"""Running the relay and the worker as long-lived processes."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import click
from prometheus_client import CollectorRegistry


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` until SIGINT or SIGTERM sets ``stop``."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        asyncio.run(runner())
    except KeyboardInterrupt:
        click.echo("stopped", err=True)


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
