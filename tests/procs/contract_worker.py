"""A worker process for the contract suite (tests/contract/), made to be
SIGKILLed mid-message, on any backend.

    python tests/procs/contract_worker.py ROLE DATABASE_URL BROKER_URL MARKER_DIR NAME

ROLE is ``worker`` or ``both`` (a relay too, for ``memory://``, whose relay
and worker must share the process).  Task ``kill_effect`` writes its effects
row through ``ctx.session``, touches ``MARKER_DIR/<job id>.running`` and then
sleeps with its transaction open: the test kills the process there, so the
effect never commits and the message is never acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import effect_values, effects

import duebox
from duebox.consumers import Worker
from duebox.relay import Relay

LEASE_SECONDS = 2.0


async def main(role: str, database_url: str, broker_url: str, marker_dir: str,
               name: str) -> None:
    markers = Path(marker_dir)
    settings = duebox.Settings(lease_seconds=LEASE_SECONDS, poll_interval=0.05,
                               clock_skew_margin=0.2)
    app = duebox.Duebox(database_url, broker_url, settings=settings)

    @app.task("kill_effect")
    def kill_effect(payload: Any, ctx: duebox.JobContext) -> None:
        ctx.session.execute(effects.insert().values(effect_values(ctx)))
        (markers / f"{ctx.job_id}.running").touch()
        time.sleep(3600)

    parts: list[Any] = [Worker(app, name=name, concurrency=1)]
    if role == "both":
        parts.append(Relay(app, name=f"{name}-relay", recover_interval=0.1))
    print("ready", flush=True)
    await asyncio.gather(*(p.run() for p in parts))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {sys.argv[5]} %(message)s")
    asyncio.run(main(*sys.argv[1:6]))
