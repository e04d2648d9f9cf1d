"""A worker process for tests/test_amqp_broker.py, made to be SIGKILLed mid-message.

    python tests/procs/amqp_worker.py DATABASE_URL BROKER_URL QUEUE MARKER_DIR

Task ``kill_effect`` on QUEUE, by ``payload["mode"]``:

* ``commit``: writes its effects row (committed with the job's completion),
  then the worker's ack never reaches RabbitMQ: ``ack`` is replaced by one
  that touches ``MARKER_DIR/<job id>.committed`` and waits forever.
* ``hang``: touches ``MARKER_DIR/<job id>.running`` and sleeps inside the
  handler, its transaction open.

The test kills the process in those states and checks what another consumer
does with the redelivered messages.
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
from duebox.brokers.amqp import AMQPBroker
from duebox.brokers.base import Delivery
from duebox.consumers import Worker

LEASE_SECONDS = 2.0


def build_app(database_url: str, broker_url: str, queue: str, markers: Path) -> duebox.Duebox:
    settings = duebox.Settings(lease_seconds=LEASE_SECONDS, poll_interval=0.1,
                               clock_skew_margin=0.2)
    app = duebox.Duebox(database_url, broker_url, settings=settings)

    @app.task("kill_effect", queue=queue)
    def kill_effect(payload: Any, ctx: duebox.JobContext) -> None:
        if payload["mode"] == "hang":
            (markers / f"{ctx.job_id}.running").touch()
            time.sleep(3600)
        ctx.session.execute(effects.insert().values(effect_values(ctx)))

    return app


async def main(database_url: str, broker_url: str, queue: str, marker_dir: str) -> None:
    markers = Path(marker_dir)

    async def ack_never_sent(self: AMQPBroker, delivery: Delivery) -> None:
        assert delivery.message is not None
        (markers / f"{delivery.message.job_id}.committed").touch()
        await asyncio.sleep(3600)

    AMQPBroker.ack = ack_never_sent  # type: ignore[method-assign]
    app = build_app(database_url, broker_url, queue, markers)
    worker = Worker(app, name="doomed-worker", concurrency=2)
    print("ready", flush=True)
    await worker.run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s doomed %(message)s")
    asyncio.run(main(*sys.argv[1:5]))
