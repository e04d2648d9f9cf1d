"""Dramatiq on Redis or RabbitMQ (BENCH_BROKER=redis|amqp).

Worker: as the ``dramatiq`` command runs it by default, one process per CPU
(BENCH_PROCESSES overrides: the ``-1p`` systems run one), each with
Dramatiq's default 8 threads and its default ``worker_timeout`` of 1000 ms;
BENCH_AGGRESSIVE=1 sets 100 ms (how long a consumer waits for a message
before it looks at its delay queue again).
Delayed jobs: ``send_with_options(delay=ms)``, rounded up to whole ms.
Dramatiq has no batch enqueue: one ``send`` per job.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import dramatiq
from peer_cli import aggressive, main
from record import record

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
def noop(due: float) -> None:
    record(due)


def enqueue(dues: list[float], delayed: bool) -> str:
    if delayed:
        for due in dues:
            noop.send_with_options(args=(due,),
                                   delay=max(0, math.ceil((due - time.time()) * 1000)))
    else:
        for due in dues:
            noop.send(due)
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
