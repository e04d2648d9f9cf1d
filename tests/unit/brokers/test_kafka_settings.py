"""duebox.brokers.kafka_settings: what a ``kafka://`` URL says — the
bootstrap list, credentials and the protocol they imply — the topic names
its prefix makes, and the client options built from it."""

from __future__ import annotations

import pytest

from duebox import ConfigurationError, ValidationError
from duebox.brokers.kafka_settings import KafkaSettings


def test_the_bootstrap_list_with_default_ports_and_ipv6() -> None:
    s = KafkaSettings.from_url("kafka://k1,k2:9093,[::1]:9094,")
    assert s.bootstrap == ("k1:9092", "k2:9093", "[::1]:9094")
    assert (s.username, s.password, s.security_protocol) == (None, None, "PLAINTEXT")
    assert s == KafkaSettings(bootstrap=s.bootstrap)  # every other field its default


def test_credentials_default_to_sasl_ssl_and_numbers_land_in_their_fields() -> None:
    s = KafkaSettings.from_url(
        "kafka://u%3Ax:p%40ss@k:9092?replication=3&prefix=x.&group=g.1&partitions=1"
        "&idempotence=FALSE&fetch_max_wait_ms=1&request_timeout_ms=1000&session_timeout_ms=3600000"
        "&max_message_size=1024&create_topics=no&check_interval=0.1&sasl_mechanism=scram-sha-512")
    assert (s.username, s.password, s.security_protocol) == ("u:x", "p@ss", "SASL_SSL")
    assert (s.replication, s.prefix, s.group, s.partitions, s.idempotence) == (
        3, "x.", "g.1", 1, "false")
    assert (s.fetch_max_wait_ms, s.request_timeout_ms, s.session_timeout_ms,
            s.max_message_size, s.create_topics, s.check_interval, s.sasl_mechanism) == (
        1, 1000, 3600000, 1024, False, 0.1, "SCRAM-SHA-512")
    assert KafkaSettings.from_url("kafka://h?replication=").replication is None


@pytest.mark.parametrize(("url", "says"), [
    ("redis://h", "must start with kafka://"),
    ("kafka://", "kafka:// needs at least one HOST:PORT"),
    ("kafka://h:0", "'h:0' is not HOST:PORT"),
    ("kafka://h:65536", "'h:65536' is not HOST:PORT"),
    ("kafka://h:x", "'h:x' is not HOST:PORT"),
    ("kafka://:9092", "':9092' is not HOST:PORT"),
    ("kafka://h?security_protocol=TLS", "security_protocol must be one of PLAINTEXT, SSL"),
    ("kafka://h?idempotence=sometimes", "idempotence must be auto, true or false"),
    ("kafka://h?partitions=0", "partitions must be an integer >= 1"),
    ("kafka://h?group=", "group must be 1 to 200 letters"),
    ("kafka://h?prefix=a/b", "prefix must be at most 100 letters"),
    ("kafka://h?groop=x", "unknown parameter 'groop' for kafka://"),
])
def test_a_bad_url_is_refused_naming_the_rule(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        KafkaSettings.from_url(url)
    assert str(refused.value).startswith(f"broker_url: {says}"), str(refused.value)


def test_topic_names() -> None:
    s = KafkaSettings(bootstrap=("h:9092",), prefix="")
    assert KafkaSettings(bootstrap=("h:9092",)).topic("mail") == "duebox.mail"
    assert s.topic("x" * 249) == "x" * 249
    for bad in ("x" * 250, ".", "..", "a b", "a/b", ""):
        with pytest.raises(ValidationError) as refused:
            s.topic(bad)
        assert refused.value.field == "queue"


def test_client_options_follow_the_protocol() -> None:
    plain = KafkaSettings.from_url("kafka://h:1").client_options("w1")
    assert plain == {"bootstrap_servers": ["h:1"], "client_id": "w1",
                     "request_timeout_ms": 10000, "security_protocol": "PLAINTEXT"}
    sasl = KafkaSettings.from_url("kafka://u:p@h:1").client_options("w1")
    assert (sasl["sasl_plain_username"], sasl["sasl_plain_password"],
            sasl["sasl_mechanism"]) == ("u", "p", "PLAIN")
    assert "ssl_context" in sasl
    assert "sasl_mechanism" not in KafkaSettings.from_url(
        "kafka://h:1?security_protocol=ssl").client_options("w1")
