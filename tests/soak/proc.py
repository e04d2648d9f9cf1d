"""One soak process: a relay or a worker, nothing else.

    python -m tests.soak.proc ROLE DATABASE_URL BROKER_URL NAME

SIGTERM stops it cleanly; the soak SIGKILLs, SIGSTOPs and clock-skews it
(libfaketime) on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from duebox.consumers import Worker
from duebox.relay import Relay
from tests.soak.app import build_app


async def main(role: str, database_url: str, broker_url: str, name: str) -> None:
    app = build_app(database_url, broker_url)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    part: Any
    if role == "relay":
        part = Relay(app, name=name, recover_interval=0.25)
    elif role == "worker":
        part = Worker(app, name=name, concurrency=8)
    else:
        raise SystemExit(f"role: must be relay or worker (got {role!r})")
    print(f"{name} ready", flush=True)
    try:
        await part.run(stop)
    finally:
        await app.adispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s {sys.argv[4]} %(levelname)s %(name)s %(message)s")
    asyncio.run(main(*sys.argv[1:5]))
