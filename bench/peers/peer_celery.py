"""Celery on Redis or RabbitMQ (BENCH_BROKER=redis|amqp).

Worker: ``celery -A peer_celery worker`` — its defaults: prefork pool,
concurrency = number of CPUs.  Delayed jobs: ``apply_async(countdown=...)``;
the worker receives them at once and holds them on its timer, so there is
no polling setting to tighten.  Celery has no batch publish: one
``apply_async`` per job.  The one task, ``noop``, records its start and
then sleeps for its ``sleep`` argument (workload C's slow jobs), in the pool
child that runs it.
"""

from __future__ import annotations

import os
import sys
import time

from celery import Celery
from peer_cli import Job, main
from record import record, tag_for

BROKER = os.environ.get("BENCH_BROKER", "redis")
PREFIX = os.environ.get("BENCH_PREFIX", "bench")

app = Celery("peer_celery", broker=os.environ.get(
    "BENCH_REDIS_URL" if BROKER == "redis" else "BENCH_AMQP_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(task_default_queue=f"{PREFIX}-celery", broker_connection_retry_on_startup=True,
                task_ignore_result=True)
if BROKER == "redis":  # every key of this run under its own prefix
    app.conf.broker_transport_options = {"global_keyprefix": f"{PREFIX}:"}


@app.task(name="noop")  # type: ignore[untyped-decorator]  # Celery ships no types
def noop(due: float, sleep: float = 0.0) -> None:
    record(due, tag_for(sleep))
    if sleep:
        time.sleep(sleep)


def enqueue(jobs: list[Job], delayed: bool) -> str:
    if delayed:
        for j in jobs:
            noop.apply_async(args=j.args, countdown=max(0.0, j.due - time.time()))
    else:
        for j in jobs:
            noop.apply_async(args=j.args)
    return "apply_async per job (no batch API)"


def worker() -> None:
    app.worker_main(["worker", "--loglevel=WARNING"])


if __name__ == "__main__":
    sys.modules.setdefault("peer_celery", sys.modules[__name__])
    main(enqueue, worker)
