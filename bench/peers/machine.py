"""What the results were measured on: CPU, memory, servers, package versions."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from typing import Any

import psycopg
import redis
from resources import PG_ADMIN, REDIS

PACKAGES = ("duebox", "celery", "kombu", "redis", "dramatiq", "pika", "pgqueuer",
            "procrastinate", "psycopg", "SQLAlchemy", "aiokafka", "boto3", "confluent-kafka",
            "py-spy")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return kib / 1024 / 1024


def _servers() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with psycopg.connect(PG_ADMIN) as c:
            out["PostgreSQL"] = str(c.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
    except psycopg.Error as exc:
        out["PostgreSQL"] = f"unreachable: {exc}"
    try:
        with redis.Redis.from_url(REDIS) as r:
            out["Redis"] = str(r.info("server")["redis_version"])
    except redis.RedisError as exc:
        out["Redis"] = f"unreachable: {exc}"
    try:
        v = subprocess.run(["rabbitmqctl", "-q", "version"], capture_output=True, text=True,
                           timeout=60)
        out["RabbitMQ"] = v.stdout.strip() or v.stderr.strip()[:200]
    except (OSError, subprocess.SubprocessError) as exc:
        out["RabbitMQ"] = f"unknown: {exc}"
    return out


def describe() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"nproc": os.cpu_count(), "cpu": _cpu_model(), "ram_gib": round(_ram_gib(), 1),
            "python": platform.python_version(), "kernel": platform.release(),
            "servers": _servers(), "packages": versions}
