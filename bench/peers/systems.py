"""The systems under test: which module, which backend, which processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class System:
    name: str
    module: str            # peer_<module>.py
    broker: str            # pg | redis | amqp | kafka | sqs
    processes: tuple[str, ...] = ("worker",)
    aggressive: str | None = None   # the "most aggressive polling" setting, None: none exists
    env: tuple[tuple[str, str], ...] = ()  # extra environment of its processes

    @property
    def is_duebox(self) -> bool:
        return self.module == "duebox"


BACKEND = {"pg": "PostgreSQL", "redis": "Redis", "amqp": "RabbitMQ",
           "kafka": "Kafka (librdkafka mock)", "sqs": "SQS (LocalStack)"}

DUEBOX_AGGRESSIVE = "DUEBOX_POLL_INTERVAL=0.05"

SYSTEMS: tuple[System, ...] = (
    System("celery-redis", "celery", "redis"),
    System("celery-amqp", "celery", "amqp"),
    System("dramatiq-redis", "dramatiq", "redis", aggressive="worker_timeout=100 ms"),
    System("dramatiq-redis-1p", "dramatiq", "redis", env=(("BENCH_PROCESSES", "1"),)),
    System("dramatiq-amqp", "dramatiq", "amqp", aggressive="worker_timeout=100 ms"),
    System("dramatiq-amqp-1p", "dramatiq", "amqp", env=(("BENCH_PROCESSES", "1"),)),
    System("pgqueuer", "pgqueuer", "pg", aggressive="dequeue_timeout=0.1 s"),
    System("procrastinate", "procrastinate", "pg", aggressive="fetch_job_polling_interval=0.1"),
    System("duebox-sql", "duebox", "pg", ("relay", "worker"), DUEBOX_AGGRESSIVE),
    System("duebox-redis", "duebox", "redis", ("relay", "worker"), DUEBOX_AGGRESSIVE),
    System("duebox-amqp", "duebox", "amqp", ("relay", "worker"), DUEBOX_AGGRESSIVE),
    System("duebox-kafka", "duebox", "kafka", ("relay", "worker"),
           DUEBOX_AGGRESSIVE + ", fetch_max_wait_ms=5"),
    System("duebox-sqs", "duebox", "sqs", ("relay", "worker"), DUEBOX_AGGRESSIVE),
)
OPTIONAL = ("duebox-sqs",)  # LocalStack: only with --sqs


def select(only: str | None, sqs: bool) -> list[System]:
    by_name = {s.name: s for s in SYSTEMS}
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"--only: unknown system(s) {', '.join(unknown)}; "
                             f"known: {', '.join(by_name)}")
        return [by_name[n] for n in names]
    return [s for s in SYSTEMS if sqs or s.name not in OPTIONAL]
