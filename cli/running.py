"""Running the relay and the worker as long-lived processes."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import click


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
