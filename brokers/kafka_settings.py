"""What a ``kafka://`` URL says, checked (see :mod:`duebox.brokers.kafka`).

Kept apart from the backend so a URL can be checked without aiokafka.
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from duebox.credentials import redacted
from duebox.errors import ConfigurationError, ValidationError

from ._common import flag, name_param, number, refuse_unknown
from .base import parse_params

_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
URL_PARAMS = frozenset({"security_protocol", "idempotence", "replication", "prefix", "group",
                        "partitions", "fetch_max_wait_ms", "request_timeout_ms",
                        "session_timeout_ms", "max_message_size", "create_topics",
                        "check_interval", "sasl_mechanism", "ssl_cafile", "max_delay"})


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: tuple[str, ...]
    username: str | None = None
    password: str | None = None
    prefix: str = "duebox."
    group: str = "duebox"
    partitions: int = 12
    replication: int | None = None
    idempotence: str = "auto"
    fetch_max_wait_ms: int = 500
    request_timeout_ms: int = 10000
    session_timeout_ms: int = 10000
    max_message_size: int = 1024 * 1024
    create_topics: bool = True
    check_interval: float = 30.0
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "PLAIN"
    ssl_cafile: str | None = None

    @classmethod
    def from_url(cls, url: str) -> KafkaSettings:
        params = parse_params(url)
        parts = urlsplit(url)
        if parts.scheme != "kafka":
            raise ConfigurationError(f"broker_url: must start with kafka:// "
                                     f"(got {redacted(url)!r})")
        refuse_unknown(params, URL_PARAMS, "kafka")
        hosts = parts.netloc.rpartition("@")[2]
        bootstrap = []
        for hp in filter(None, hosts.split(",")):
            host, _, port = hp.rpartition(":") if ":" in hp.rpartition("]")[2] else (hp, "", "9092")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigurationError(f"broker_url: {hp!r} is not HOST:PORT")
            bootstrap.append(f"{host}:{port}")
        if not bootstrap:
            raise ConfigurationError("broker_url: kafka:// needs at least one HOST:PORT")
        user = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password else None
        protocol = params.get("security_protocol", "SASL_SSL" if user else "PLAINTEXT").upper()
        if protocol not in _PROTOCOLS:
            raise ConfigurationError(f"broker_url: security_protocol must be one of "
                                     f"{', '.join(_PROTOCOLS)} (got {protocol!r})")
        idempotence = params.get("idempotence", "auto").lower()
        if idempotence not in ("auto", "true", "false"):
            raise ConfigurationError(f"broker_url: idempotence must be auto, true or false "
                                     f"(got {idempotence!r})")
        replication = params.get("replication")
        return cls(
            bootstrap=tuple(bootstrap), username=user, password=password,
            prefix=name_param(params, "prefix", "duebox.", r"[A-Za-z0-9._-]{0,100}",
                              "at most 100 letters, digits, '.', '-' or '_'"),
            group=name_param(params, "group", "duebox", r"[A-Za-z0-9._-]{1,200}",
                             "1 to 200 letters, digits, '.', '-' or '_'"),
            partitions=int(number(params, "partitions", 12, low=1, high=10000, integer=True)),
            replication=None if not replication else int(
                number(params, "replication", 1, low=1, high=100, integer=True)),
            idempotence=idempotence,
            fetch_max_wait_ms=int(number(params, "fetch_max_wait_ms", 500, low=1, high=60000,
                                         integer=True)),
            request_timeout_ms=int(number(params, "request_timeout_ms", 10000, low=1000,
                                          high=300000, integer=True)),
            session_timeout_ms=int(number(params, "session_timeout_ms", 10000, low=1000,
                                          high=3600000, integer=True)),
            max_message_size=int(number(params, "max_message_size", 1024 * 1024, low=1024,
                                        high=100 * 1024 * 1024, integer=True)),
            create_topics=flag(params, "create_topics", True),
            check_interval=number(params, "check_interval", 30.0, low=0.1),
            security_protocol=protocol,
            sasl_mechanism=params.get("sasl_mechanism", "PLAIN").upper(),
            ssl_cafile=params.get("ssl_cafile") or None,
        )

    def topic(self, queue: str) -> str:
        name = self.prefix + queue
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", name) or name in (".", ".."):
            raise ValidationError(
                "queue", f"must make a Kafka topic name of 1 to 249 letters, digits, '.', "
                f"'-' or '_' (not '.' or '..') with the prefix {self.prefix!r} ({name!r})",
                queue)
        return name

    def client_options(self, client_id: str) -> dict[str, Any]:
        options: dict[str, Any] = {
            "bootstrap_servers": list(self.bootstrap), "client_id": client_id,
            "request_timeout_ms": self.request_timeout_ms,
            "security_protocol": self.security_protocol,
        }
        if "SSL" in self.security_protocol:
            options["ssl_context"] = ssl.create_default_context(cafile=self.ssl_cafile)
        if "SASL" in self.security_protocol:
            options.update(sasl_mechanism=self.sasl_mechanism,
                           sasl_plain_username=self.username,
                           sasl_plain_password=self.password)
        return options
