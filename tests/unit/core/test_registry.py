"""duebox.registry: a broker URL names a known backend or is refused
before anything runs, naming the rule; ``?max_delay=`` may only lower a
backend's ceiling; a queue name is checked for its backend without a
connection; and a job's size limit is the broker's, less the envelope."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from duebox import ConfigurationError, ValidationError, registry
from duebox.brokers.memory import MemoryBroker
from duebox.registry import (
    ENVELOPE_ALLOWANCE,
    broker_class,
    check_broker_url,
    check_queue_name,
    effective_max_delay,
    message_limit,
    register_broker,
)


@pytest.mark.parametrize(("url", "rule"), [
    ("", "must start with a scheme, one of amqp, amqps, kafka, memory, redis, rediss, sql, sqs://"),
    ("localhost:6379", "unknown scheme 'localhost'"),
    ("nats://h", "unknown scheme 'nats'; known: amqp://, "),
    ("redis://[::1", "not a URL (Invalid IPv6 URL)"),
    ("amqp://u:p/w@h/", "'/' before the URL's last '@'"),
    ("redis://h/0?max_delay=-1", "max_delay must be a number of seconds >= 0 (got '-1')"),
    ("redis://h/0?max_delay=nan", "max_delay must be a number of seconds >= 0"),
    ("redis://h/0?max_delay=soon", "max_delay must be a number of seconds >= 0"),
    ("sqs://?max_delay=901", "max_delay=901 exceeds this backend's ceiling of 900 s"),
])
def test_a_bad_broker_url_is_refused_naming_the_rule(url: str, rule: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        check_broker_url(url)
    assert str(refused.value).startswith(f"broker_url: {rule}"), str(refused.value)


def test_schemes_are_case_blind_and_tls_schemes_share_their_backend() -> None:
    assert broker_class("MEMORY://x") is MemoryBroker
    assert broker_class("rediss://h") is broker_class("redis://h")
    assert broker_class("amqps://h") is broker_class("amqp://h")


@pytest.mark.parametrize(("native", "raw", "effective"), [
    (None, None, None), (900.0, None, 900.0), (900.0, "900", 900.0), (900.0, "0", 0.0),
    (None, "3600", 3600.0), (0.0, "0", 0.0),
])
def test_max_delay_lowers_the_ceiling(native: float | None, raw: str | None,
                                      effective: float | None) -> None:
    params = {} if raw is None else {"max_delay": raw}
    assert effective_max_delay(native, params) == effective


@pytest.mark.parametrize(("url", "native"), [
    ("sql://", None), ("memory://", None), ("redis://h", None), ("sqs://", 256 * 1024),
    ("sqs://?max_message_size=4096", 4096),
    ("kafka://h:9092?max_message_size=1500", 1500),  # smaller than the envelope: nothing fits
])
def test_a_jobs_size_limit_is_the_brokers_less_the_envelope(url: str, native: int | None
                                                            ) -> None:
    size, why = message_limit(url, 10**6)
    if native is None:
        assert (size, why) == (10**6, "max_payload_bytes")
    else:
        scheme = url.split(":")[0]
        assert size == max(0, native - ENVELOPE_ALLOWANCE)
        assert why == (f"the {scheme}:// message limit of {native} bytes less "
                       f"{ENVELOPE_ALLOWANCE} for the envelope")


@pytest.mark.parametrize(("url", "name"), [
    ("memory://", ""), ("memory://", "q" * 201), ("memory://", 5), ("memory://", "a\nb"),
    ("memory://", "bidi\u202e"), ("amqp://h/", "a.*.b"), ("redis://h", "a{b}"),
    ("sqs://", "has space"), ("kafka://h:9092", "a/b"),
])
def test_a_queue_name_the_backend_cannot_use_is_refused_as_queue(url: str, name: object
                                                                 ) -> None:
    with pytest.raises(ValidationError) as refused:
        check_queue_name(url, name)
    assert refused.value.field == "queue"


def test_a_queue_name_every_backend_takes() -> None:
    for url in ("sql://", "memory://", "amqp://h/", "redis://h", "sqs://", "kafka://h:9092"):
        check_queue_name(url, "emails-2_x")
        check_queue_name(url, "q" * 20)


@pytest.fixture
def nats() -> Iterator[None]:
    yield
    registry._SCHEMES.pop("nats", None)  # the test's own scheme, forgotten
    registry._check_for_backend.cache_clear()


@pytest.mark.usefixtures("nats")
def test_a_backend_can_be_added_by_scheme() -> None:
    imported: list[str] = []

    def nats_backend() -> type[MemoryBroker]:
        imported.append("nats")  # imported when first used, not when registered
        return MemoryBroker

    register_broker("NATS", nats_backend)
    assert imported == []
    assert broker_class("nats://h") is MemoryBroker
    assert imported
    check_broker_url("nats://h?max_delay=5")


def test_a_backend_that_is_not_a_function_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="backend must be a function"):
        register_broker("nats", "duebox.brokers.memory:MemoryBroker")  # type: ignore[arg-type]
