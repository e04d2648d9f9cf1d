"""CPU µs per job of the relay's per-message Python, stage by stage, with no
database and no broker: building the message, its body, and what each
backend's client makes of it (issue #20).

    python bench/relay_micro.py [ROUNDS]

500 records (a payload of one key, due in 5 minutes) become fresh messages
in every round; each figure is the best round's process CPU time ÷ 500
(best of ROUNDS, default 40), so it moves little with the machine's load.
Run it with two trees' interpreters back to back to compare them.  The id
goes into the Redis arguments and AMQP properties as ``str(job_id)``, as
main's backends wrote it, so that any tree runs this; this branch's
backends use the message's cached ``id_text``, a little cheaper still.
"""

from __future__ import annotations

import math
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pika
from pika import frame, spec

from duebox.brokers.kafka_publish import murmur2
from duebox.leases.records import records
from duebox.metrics import Metrics
from duebox.relay.held import HeldJobs
from duebox.relay.stats import RelayMetrics
from duebox.seam import Outgoing

N = 500
NOW = datetime.now(UTC)
IDS = [uuid.uuid4() for _ in range(N)]
RECORDS = records([(IDS[i], "noop", "default", {"i": i}, None, NOW + timedelta(seconds=300), 1,
                    0, 3, 0, None, None, None, "relay:x#1", 1, None, None) for i in range(N)])
HELD = HeldJobs(lead=0.03, max_delay=None, precision=0.001)


def outgoing() -> list[Outgoing]:
    return [Outgoing(r.to_message(), HELD.delay(r, NOW)) for r in RECORDS]


def body() -> None:
    for o in outgoing():
        o.message.encode()


def redis_args() -> None:
    now_ms = NOW.timestamp() * 1000.0
    args: list[object] = []
    for o in outgoing():
        m = o.message
        args += [str(m.job_id), m.version, math.ceil(now_ms + o.delay * 1000.0), m.encode()]


def kafka_record() -> None:
    for o in outgoing():
        m = o.message
        m.encode()
        [(k, v.encode()) for k, v in m.header_map().items()]
        murmur2(m.ordering_key().encode())


def pika_frames() -> None:
    for o in outgoing():
        m = o.message
        props = pika.BasicProperties(content_type="application/json", delivery_mode=2,
                                     message_id=str(m.job_id), timestamp=int(time.time()),
                                     type=m.task, headers=m.header_map())
        data = m.encode()
        frame.Method(1, spec.Basic.Publish(exchange="x", routing_key="q",
                                           mandatory=True)).marshal()
        frame.Header(1, len(data), props).marshal()
        frame.Body(1, data).marshal()


def metrics() -> None:
    observe = RelayMetrics(Metrics(), "redis")
    observe.claimed(RECORDS, NOW)
    observe.published(RECORDS, set(IDS), NOW, NOW, 0.0)


STAGES: dict[str, Callable[[], object]] = {
    "record -> message + Outgoing + delay": outgoing,
    "  + body (encode)": body,
    "redis: + publish args (id, version, score, body)": redis_args,
    "kafka: + body, headers, key, murmur2": kafka_record,
    "amqp: + pika properties, body, frames": pika_frames,
    "metrics: claimed + published": metrics,
}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    for name, stage in STAGES.items():
        best = math.inf
        for _ in range(rounds):
            t = time.process_time()
            stage()
            best = min(best, time.process_time() - t)
        print(f"{best / N * 1e6:7.2f} µs/job  {name}")


if __name__ == "__main__":
    main()
