"""Fresh, private resources for one system's workload on the shared servers:
its own PostgreSQL database, Redis key prefix and RabbitMQ vhost, Kafka
topic prefix and group, SQS queue prefix; all removed afterwards."""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import redis
from systems import System

PG_ADMIN = os.environ.get("BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0")
AMQP = os.environ.get("BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672")


def _test_backends() -> Any:
    """``tests/backends.py``, loaded by path under a name of its own
    (``bench/peers`` is first on ``sys.path``; see bench/backends_services.py)."""
    name = "duebox_test_backends"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[2] / "tests" / "backends.py")
        assert spec is not None
        assert spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextmanager
def pg_database(tag: str) -> Iterator[str]:
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{tag}"')
        try:
            yield PG_ADMIN.rsplit("/", 1)[0] + "/" + tag
        finally:  # on a new connection: a server restart meanwhile ended this one
            with psycopg.connect(PG_ADMIN, autocommit=True) as again:
                again.execute(f'DROP DATABASE IF EXISTS "{tag}" WITH (FORCE)')


@contextmanager
def redis_prefix(tag: str) -> Iterator[str]:
    try:
        yield tag
    finally:  # only this run's keys
        with redis.Redis.from_url(REDIS) as client:
            keys = list(client.scan_iter(match=f"{tag}*", count=1000))
            for i in range(0, len(keys), 500):
                client.delete(*keys[i:i + 500])


@contextmanager
def amqp_vhost(tag: str) -> Iterator[str]:
    with _test_backends().scratch_vhost(tag, "guest"):
        yield f"{AMQP.rstrip('/')}/{tag}"


@contextmanager
def environment(system: System, kafka: str | None, sqs: str | None,
                record_dir: str) -> Iterator[dict[str, str]]:
    """The environment variables of every process of one workload."""
    tag = f"bp{uuid.uuid4().hex[:10]}"
    with pg_database(tag) as pg:
        env = {"BENCH_PG_URL": pg, "BENCH_PREFIX": tag, "BENCH_RECORD_DIR": record_dir,
               "BENCH_BROKER": system.broker, "BENCH_REDIS_URL": REDIS,
               "DUEBOX_DATABASE_URL": pg.replace("postgresql://", "postgresql+psycopg://", 1)}
        if system.broker == "amqp":
            with amqp_vhost(tag) as vhost:
                env["BENCH_AMQP_URL"] = vhost
                env["DUEBOX_BROKER_URL"] = vhost
                yield env
            return
        with redis_prefix(tag):
            env["DUEBOX_BROKER_URL"] = {
                "pg": "sql://",
                "redis": f"{REDIS}?prefix={tag}",
                "kafka": f"kafka://{kafka}?prefix={tag}.&group={tag}",
                "sqs": f"sqs://test:test@{(sqs or '').split('://', 1)[-1]}?prefix={tag}-",
            }[system.broker]
            yield env
