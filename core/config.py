"""Settings: every knob with its ``DUEBOX_*`` environment variable and its check."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import ConfigurationError
from .fairness.policy import DispatchPolicy
from .leases import own_queues
from .routes import check_routes, parse_routes
from .secret_keys import DEFAULT_MASK_KEYS, SecretKeys, parse_mask_keys
from .validation import MAX_SPAN

DEFAULT_DATABASE_URL = "sqlite:///duebox.db"
DEFAULT_BROKER_URL = "sql://"
REMOVED_SCHEDULES = ("pause", "delete")


@dataclass(frozen=True)
class Settings:
    """Tuning shared by the relay and the worker.

    Durations are seconds.  ``clock_skew_margin`` is added to every lease
    expiry comparison so a node whose clock runs a little fast cannot take a
    job whose owner is still within its lease.
    """

    database_url: str = DEFAULT_DATABASE_URL
    broker_url: str = DEFAULT_BROKER_URL
    batch_size: int = 500
    poll_interval: float = 1.0
    lease_seconds: float = 30.0
    clock_skew_margin: float = 2.0
    # A job the broker accepted but no worker started within this long after
    # its due time is published again (a broker that lost it: Redis without
    # AOF, a purged queue).  Consumers drop the duplicate by outbox id.
    redeliver_after: float = 900.0
    concurrency: int = 8
    # Most jobs a worker runs in one transaction when it has a backlog of
    # short ones (each in its own savepoint; consumers/batch.py); 1
    # gives every job a transaction of its own.
    group_commit: int = 32
    notify: bool = True
    # Catch-up after an outage (see docs/schedules.md): jobs overdue by more
    # than ``catchup_after`` are released at most ``catchup_rate`` per second
    # per relay, most urgent first; a schedule's fire time older than
    # ``misfire_grace`` counts as missed and its misfire policy applies.
    catchup_rate: float = 100.0
    catchup_after: float = 60.0
    misfire_grace: float = 60.0
    # The largest payload (with headers) schedule() accepts, in bytes of JSON;
    # a broker with a smaller message limit lowers it further.
    max_payload_bytes: int = 1024 * 1024
    # Priority, fair shares, quotas and rate limits (docs/scale.md): a
    # DispatchPolicy, a mapping of its fields, or that mapping as JSON.  The
    # relay and the sql:// worker apply the same one; unset, both read
    # DUEBOX_DISPATCH_POLICY when they start.
    dispatch_policy: DispatchPolicy | Mapping[str, Any] | str | None = None
    # What a relay's sync does to a schedule declared in code that is no
    # longer declared: "pause" it (kept, with its history; declared again,
    # it resumes) or "delete" it (its pending occurrences still run).
    removed_schedules: str = "pause"
    # Queues a consumer of your own reads (docs/own-consumers.md): the relay
    # marks their jobs DELIVERED once the broker confirmed the publish, and
    # no duebox worker is expected for them.  A list of names, or one
    # comma-separated string (DUEBOX_OWN_CONSUMER_QUEUES=emails,sms).
    own_consumer_queues: tuple[str, ...] | str = ()
    # Per-queue broker routing (docs/brokers.md, "Routing"): queue -> broker
    # URL, or its text form ``queue=URL,queue=URL`` / a JSON object; queues
    # not named go through ``broker_url``.
    broker_routes: Mapping[str, str] | str | None = None
    # Payload keys whose values nobody sees (logs, `duebox jobs show`, `dlq`,
    # the dashboard), also where error text quotes them: every key holding
    # one of these words, ignoring case, "_" and "-" (duebox.secret_keys).
    # A list, a comma-separated string, or "none"; a task may name its own.
    mask_keys: tuple[str, ...] | str = DEFAULT_MASK_KEYS
    # One log line per finished job (logger ``duebox.jobs``, INFO): task,
    # id, attempt, run time, start lateness, outcome.  Off by default: at
    # thousands of jobs a second the lines cost (docs/observability.md).
    log_jobs: bool = False
    # Results of tasks with store_result=True (duebox.reads.results): the most a
    # result may weigh, in bytes of JSON, and how long it is kept after the
    # job finished unless the task says otherwise (then relays delete it).
    max_result_bytes: int = 64 * 1024
    result_ttl: float = 86_400.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mask_keys", parse_mask_keys(self.mask_keys))
        object.__setattr__(self, "own_consumer_queues",
                           own_queues.parse(self.own_consumer_queues))
        if self.dispatch_policy is not None:
            object.__setattr__(self, "dispatch_policy", DispatchPolicy.parse(self.dispatch_policy))
        _positive_int("batch_size", self.batch_size, upper=100_000)
        _positive_int("concurrency", self.concurrency, upper=10_000)
        _positive_int("group_commit", self.group_commit, upper=1_000)
        _positive_int("max_payload_bytes", self.max_payload_bytes, upper=512 * 1024 * 1024)
        _positive_int("max_result_bytes", self.max_result_bytes, upper=512 * 1024 * 1024)
        for name in ("poll_interval", "lease_seconds", "redeliver_after", "catchup_rate",
                     "catchup_after", "misfire_grace", "result_ttl"):
            value = getattr(self, name)
            if not _finite(value) or not 0 < value <= _MOST:
                raise ConfigurationError(
                    f"{name}: must be a number > 0 and at most {_MOST:.0f} (got {value!r})")
        if not _finite(self.clock_skew_margin) or not 0 <= self.clock_skew_margin <= _MOST:
            raise ConfigurationError(f"clock_skew_margin: must be a number from 0 to {_MOST:.0f} "
                                     f"(got {self.clock_skew_margin!r})")
        if not isinstance(self.log_jobs, bool):
            raise ConfigurationError(f"log_jobs: must be True or False (got {self.log_jobs!r})")
        if self.removed_schedules not in REMOVED_SCHEDULES:
            raise ConfigurationError(
                "removed_schedules: must be one of " + ", ".join(REMOVED_SCHEDULES)
                + f" (got {self.removed_schedules!r})")
        for name in ("database_url", "broker_url"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigurationError(f"{name}: must be a non-empty URL string")
        routes = parse_routes(self.broker_routes)
        check_routes(routes)
        object.__setattr__(self, "broker_routes", routes or None)

    @property
    def routes(self) -> Mapping[str, str]:
        """``broker_routes`` as parsed: queue -> broker URL (empty: none)."""
        routes = self.broker_routes
        return routes if isinstance(routes, Mapping) else {}

    @property
    def own_queues(self) -> tuple[str, ...]:
        """``own_consumer_queues``, as checked (always a tuple)."""
        value = self.own_consumer_queues
        return value if isinstance(value, tuple) else own_queues.parse(value)

    @property
    def secret_keys(self) -> SecretKeys:
        """``mask_keys``, as what masks payloads and error text."""
        keys = self.mask_keys
        return SecretKeys.of(keys if isinstance(keys, tuple) else parse_mask_keys(keys))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"DUEBOX_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            values[f.name] = _convert(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _convert(name: str, type_name: object, raw: str) -> Any:
    env_name = f"DUEBOX_{name.upper()}"
    try:
        if type_name in ("int", int):
            return int(raw)
        if type_name in ("float", float):
            return float(raw)
        if type_name in ("bool", bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except ValueError:
        raise ConfigurationError(
            f"{env_name}: must be a {type_name} (got {raw!r})"
        ) from None
    return raw


# Durations are added to instants: at most 100 years (duebox.validation.MAX_SPAN),
# so no instant plus one overflows.
_MOST = MAX_SPAN.total_seconds()


def _finite(value: object) -> bool:
    # NaN and infinity pass every `<= 0` test; a bool is an int by accident.
    # math.isfinite() of an int beyond any float raises OverflowError.
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and (isinstance(value, int) or math.isfinite(value)))


def _positive_int(name: str, value: object, upper: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
        raise ConfigurationError(f"{name}: must be an integer from 1 to {upper} (got {value!r})")

