"""What an ``sqs://`` URL says, checked (see :mod:`duebox.brokers.sqs`).

Kept apart from the backend so a URL can be checked without boto3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from duebox.credentials import redacted
from duebox.errors import ConfigurationError, ValidationError

from ._common import flag, name_param, number, refuse_unknown
from .base import parse_params

MAX_DELAY_SECONDS = 900  # SQS's DelaySeconds ceiling
MAX_VISIBILITY = 43200  # 12 hours, SQS's cap on a received message's invisibility
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
URL_PARAMS = frozenset({"endpoint", "tls", "region", "prefix", "fifo", "wait",
                        "visibility_timeout", "threads", "max_message_size", "create",
                        "check_interval", "align", "max_delay"})


@dataclass(frozen=True)
class SQSSettings:
    """What an ``sqs://`` URL says."""

    region: str | None = None
    endpoint: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    prefix: str = "duebox-"
    fifo: bool = False
    wait: int = 10
    # Short, and extended every second while a message is held: a dead
    # worker's messages reappear within 3 s (issue #18).
    visibility_timeout: int = 3
    threads: int = 8
    max_message_size: int = 256 * 1024
    create: bool = True
    check_interval: float = 60.0
    align: float = 0.02

    @classmethod
    def from_url(cls, url: str) -> SQSSettings:
        params = parse_params(url)
        parts = urlsplit(url)
        if parts.scheme != "sqs":
            raise ConfigurationError(f"broker_url: must start with sqs:// "
                                     f"(got {redacted(url)!r})")
        refuse_unknown(params, URL_PARAMS, "sqs")
        endpoint = params.get("endpoint") or None
        host = parts.hostname
        if host and endpoint:
            raise ConfigurationError("broker_url: give the SQS endpoint either as the URL's "
                                     "host or as ?endpoint=, not both")
        if host:
            tls = flag(params, "tls", host not in _LOOPBACK)
            netloc = f"[{host}]" if ":" in host else host
            try:
                port = parts.port
            except ValueError as exc:
                raise ConfigurationError(f"broker_url: {exc}") from None
            endpoint = f"{'https' if tls else 'http'}://{netloc}" + (f":{port}" if port else "")
        elif "tls" in params:
            raise ConfigurationError("broker_url: tls applies only with a host in the URL")
        if endpoint is not None and not re.match(r"https?://[^/?#]+/?$", endpoint):
            raise ConfigurationError(
                f"broker_url: endpoint must be an http(s)://host[:port] URL (got {endpoint!r})")
        if bool(parts.username) != bool(parts.password):
            raise ConfigurationError("broker_url: give both the access key and the secret "
                                     "(sqs://KEY:SECRET@...) or neither")
        region = params.get("region") or None
        if region is not None and not re.fullmatch(r"[a-z0-9-]{1,40}", region):
            raise ConfigurationError(f"broker_url: region must look like us-east-1 "
                                     f"(got {region!r})")
        if region is None and endpoint is not None:
            region = "us-east-1"  # LocalStack and most emulators need some region
        return cls(
            region=region,
            endpoint=endpoint.rstrip("/") if endpoint else None,
            access_key=unquote(parts.username) if parts.username else None,
            secret_key=unquote(parts.password) if parts.password else None,
            prefix=name_param(params, "prefix", "duebox-", r"[A-Za-z0-9_-]{0,40}",
                              "at most 40 letters, digits, '-' or '_'"),
            fifo=flag(params, "fifo", False),
            wait=int(number(params, "wait", 10, low=0, high=20, integer=True)),
            visibility_timeout=int(number(params, "visibility_timeout", 3, low=1,
                                          high=MAX_VISIBILITY, integer=True)),
            threads=int(number(params, "threads", 8, low=1, high=64, integer=True)),
            max_message_size=int(number(params, "max_message_size", 256 * 1024, low=1024,
                                        high=1024 * 1024, integer=True)),
            create=flag(params, "create", True),
            check_interval=number(params, "check_interval", 60.0, low=0.1),
            align=number(params, "align", 0.02, low=0.0, high=1.0),
        )

    def queue_name(self, queue: str, fifo: bool | None = None) -> str:
        fifo = self.fifo if fifo is None else fifo
        name = self.prefix + queue + (".fifo" if fifo else "")
        if not re.fullmatch(r"[A-Za-z0-9_-]+(\.fifo)?", name) or len(name) > 80:
            raise ValidationError(
                "queue", f"must make an SQS queue name of at most 80 letters, digits, '-' or "
                f"'_' with the prefix {self.prefix!r}{' and .fifo' if fifo else ''} "
                f"({name!r})", queue)
        return name
