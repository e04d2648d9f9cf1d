"""A relay process for tests/test_ratelimit.py and tests/test_shards.py.

    python tests/procs/scale_relay.py DATABASE_URL BROKER_URL NAME [SHARDS SHARD_TTL]

The dispatch policy comes from ``DUEBOX_DISPATCH_POLICY`` (JSON).  With
SHARDS the relay shards with leases of SHARD_TTL seconds.  On SIGTERM it
stops cleanly and prints its totals as one JSON line, so the test can see
what it claimed, published, marked and dropped as fenced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import sys

import duebox
from duebox.relay import Relay
from duebox.relay.shards import ShardConfig

LEASE_SECONDS = 2.0


async def main(database_url: str, broker_url: str, name: str, *shard_args: str) -> None:
    settings = duebox.Settings(lease_seconds=LEASE_SECONDS, poll_interval=0.1,
                               clock_skew_margin=0.3, batch_size=10, catchup_after=3600.0)
    app = duebox.Duebox(database_url, broker_url, settings=settings)
    app.add_task("proc_job", lambda payload, ctx: None)
    shards = ShardConfig(int(shard_args[0]), float(shard_args[1])) if shard_args else None
    relay = Relay(app, name=name, recover_interval=0.25, shards=shards, heartbeat_interval=0.5)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"{name} ready", flush=True)
    try:
        await relay.run(stop)
    finally:
        print(json.dumps(dataclasses.asdict(relay.totals)), flush=True)
        await app.adispose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {sys.argv[3]} %(message)s")
    asyncio.run(main(*sys.argv[1:]))
