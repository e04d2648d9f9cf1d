"""Dramatiq on Redis or RabbitMQ (BENCH_BROKER=redis|amqp).

Worker: as the ``dramatiq`` command runs it by default, one process per CPU
(BENCH_PROCESSES overrides: the ``-1p`` systems run one), each with
Dramatiq's default 8 threads and its default ``worker_timeout`` of 1000 ms;
BENCH_AGGRESSIVE=1 sets 100 ms (how long a consumer waits for a message
before it looks at its delay queue again).
Delayed jobs: ``send_with_options(delay=ms)``, rounded up to whole ms.
Dramatiq has no batch enqueue: one ``send`` per job.  The one actor,
``noop``, records its start and then sleeps for its ``sleep`` argument
(workload C's slow jobs) in the worker thread that runs it.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import dramatiq
from peer_cli import Job, aggressive, main
from record import record, tag_for

BROKER = os.environ.get("BENCH_BROKER", "redis")
PREFIX = os.environ.get("BENCH_PREFIX", "bench")

if BROKER == "redis":
    from dramatiq.brokers.redis import RedisBroker

    broker: dramatiq.Broker = RedisBroker(  # type: ignore[no-untyped-call]
        url=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
        namespace=f"{PREFIX}-dramatiq")
else:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker = RabbitmqBroker(url=os.environ["BENCH_AMQP_URL"])
dramatiq.set_broker(broker)


@dramatiq.actor(actor_name="noop", queue_name="bench", max_retries=0)
def noop(due: float, sleep: float = 0.0) -> None:
    record(due, tag_for(sleep))
    if sleep:
        time.sleep(sleep)


def enqueue(jobs: list[Job], delayed: bool) -> str:
    if delayed:
        for j in jobs:
            noop.send_with_options(args=j.args,
                                   delay=max(0, math.ceil((j.due - time.time()) * 1000)))
    else:
        for j in jobs:
            noop.send(*j.args)
    return "send per job (no batch API)"


def worker() -> None:
    processes = int(os.environ.get("BENCH_PROCESSES") or os.cpu_count() or 1)
    children = []
    for _ in range(processes - 1):  # forked: the harness's killpg stops them all
        pid = os.fork()
        if pid == 0:
            _one_worker()
            os._exit(0)
        children.append(pid)
    _one_worker()
    for pid in children:
        os.waitpid(pid, 0)


def _one_worker() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    w = dramatiq.Worker(broker, worker_threads=8, worker_timeout=100 if aggressive() else 1000)
    w.start()
    stop.wait()
    w.stop()


if __name__ == "__main__":
    main(enqueue, worker)
