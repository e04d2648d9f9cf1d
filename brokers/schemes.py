"""Which backend serves each URL scheme: the built-in backends, registered
with core's registry (core/registry.py).

Each is registered as a function that imports its module when a URL of its
scheme is first checked or opened, so ``import duebox`` imports no driver.
The package ``duebox`` imports this module (pyproject.toml's contracts list
that import), so the schemes are known as soon as ``duebox`` is.
"""

from __future__ import annotations

import functools

from duebox.registry import register_broker, register_routed_broker

from .base import Broker


def backend(scheme: str) -> type[Broker]:
    """The class of the built-in backend for ``scheme``, its module imported now."""
    match scheme:
        case "sql":
            from .sql import SQLBroker
            return SQLBroker
        case "memory":
            from .memory import MemoryBroker
            return MemoryBroker
        case "amqp" | "amqps":
            from .amqp import AMQPBroker
            return AMQPBroker
        case "redis" | "rediss":  # rediss: Redis over TLS
            from .redis import RedisBroker
            return RedisBroker
        case "sqs":
            from .sqs import SQSBroker
            return SQSBroker
        case "kafka":
            from .kafka import KafkaBroker
            return KafkaBroker
    raise ValueError(f"no built-in backend for {scheme!r}")


def routed() -> type[Broker]:
    """The broker over several routes (brokers/routed.py)."""
    from .routed import RoutedBroker
    return RoutedBroker


SCHEMES = ("sql", "memory", "amqp", "amqps", "redis", "rediss", "sqs", "kafka")
for _scheme in SCHEMES:
    register_broker(_scheme, functools.partial(backend, _scheme))
register_routed_broker(routed)

__all__ = ["SCHEMES", "backend", "routed"]
