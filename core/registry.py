"""Broker backends by URL scheme, resolved lazily so no driver is imported
until its backend is used."""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigurationError

BROKERS: dict[str, str] = {
    "sql": "duebox.brokers.sql:SQLBroker",
    "memory": "duebox.brokers.memory:MemoryBroker",
}


def broker_class(url: str) -> Any:
    scheme = urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    if not scheme:
        raise ConfigurationError(
            f"broker_url: must start with a scheme, one of {', '.join(sorted(BROKERS))}:// "
            f"(got {url!r})"
        )
    target = BROKERS.get(scheme)
    if target is None:
        raise ConfigurationError(
            f"broker_url: unknown scheme {scheme!r}; known: "
            f"{', '.join(s + '://' for s in sorted(BROKERS))}"
        )
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def register_broker(scheme: str, target: str) -> None:
    """Add a backend: ``register_broker("nats", "mypkg.nats:NatsBroker")``."""
    BROKERS[scheme.lower()] = target
