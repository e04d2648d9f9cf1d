"""Broker URLs: an unknown scheme, a bad or misspelt parameter is a
ConfigurationError naming ``broker_url`` and the parameter — when the app is
made or configured, or at the latest when the backend is built, before
anything connects — and the settings stay as they were."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest
from helpers import memory_url
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import duebox
from duebox import ConfigurationError

from .common import SQLITE_ONLY, nothing_written

BASES = {"redis": "redis://127.0.0.1:1/0", "amqp": "amqp://guest:guest@127.0.0.1:1/v",
         "sqs": "sqs://k:s@127.0.0.1:1", "kafka": "kafka://127.0.0.1:1",
         "memory": "memory://urls", "sql": "sql://"}
# Every parameter some backend reads, so the fuzzer tries each on each backend.
PARAMS = ["max_delay", "prefix", "group", "horizon", "claim_idle", "delay_mode", "queue_type",
          "confirm_timeout", "endpoint", "tls", "region", "fifo", "wait", "visibility_timeout",
          "threads", "max_message_size", "create", "check_interval", "align", "partitions",
          "replication", "idempotence", "fetch_max_wait_ms", "request_timeout_ms",
          "session_timeout_ms", "create_topics", "security_protocol", "sasl_mechanism",
          "heartbeat", "socket_timeout"]
VALUES = ["", "-1", "0", "1", "nan", "inf", "1e999", "abc", "1.5", "true", "x" * 300, "a b",
          "{}", "99999999999999999999", "http://h"]


@SQLITE_ONLY
@pytest.mark.parametrize("broker_url", ["nats://localhost", "localhost:5672", "no-scheme", "",
                                        "://x"])
def test_an_unknown_broker_is_refused_when_the_app_is_made(
    database_url: str, broker_url: str
) -> None:
    if broker_url:
        with pytest.raises(ConfigurationError, match="broker_url"):
            duebox.Duebox(database_url, broker_url)
    app = duebox.Duebox(database_url)
    try:
        with pytest.raises(ConfigurationError, match="broker_url"):
            app.configure(broker_url=broker_url or " ")
        assert app.settings.broker_url == "sql://"  # unchanged
        nothing_written(app.engine)
    finally:
        app.dispose()


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon", "-0.001"])
@SQLITE_ONLY
def test_a_bad_max_delay_is_refused_before_anything_runs(database_url: str, value: str) -> None:
    bad = f"{memory_url()}?max_delay={value}"
    app = duebox.Duebox(database_url, memory_url())
    try:
        for make in (lambda: duebox.Duebox(database_url, bad),
                     lambda: app.configure(broker_url=bad)):
            with pytest.raises(ConfigurationError) as info:
                make()
            assert "broker_url" in str(info.value)
            assert "max_delay" in str(info.value)
        assert "max_delay" not in app.settings.broker_url
        nothing_written(app.engine)
    finally:
        app.dispose()


@pytest.mark.parametrize("scheme", ["redis", "sqs", "kafka", "amqp"])
def test_a_misspelt_parameter_is_refused_not_ignored(scheme: str) -> None:
    """``?prefx=`` must not quietly mean the default prefix: another
    deployment's queues."""
    app = duebox.Duebox("sqlite://")
    try:
        app.configure(broker_url=f"{BASES[scheme]}?prefx=mine")
        with pytest.raises(ConfigurationError) as info:
            app.broker()
        assert "broker_url" in str(info.value)
        assert "prefx" in str(info.value)
    finally:
        app.dispose()


@pytest.mark.parametrize("scheme", sorted(BASES))
def test_any_parameters_build_the_backend_or_are_refused_by_name(scheme: str) -> None:
    """Whatever the query string holds, building the backend either works or
    raises ConfigurationError naming broker_url — never another exception."""
    app = duebox.Duebox("sqlite://")

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(PARAMS), st.sampled_from(VALUES), min_size=1,
                           max_size=3))
    def check(params: dict[str, str]) -> None:
        url = f"{BASES[scheme]}?{urlencode(params)}"
        refused = ""
        try:
            app.configure(broker_url=url)
            app.broker()
        except ConfigurationError as exc:
            refused = str(exc)
        assert not refused or "broker_url" in refused, refused

    try:
        check()
    finally:
        app.dispose()


NETLOCS = ["guest@h", "guest:@h", ":pw@h", "@h", "u:p@", "u%00:p@h", "u:p%ff@h", "h:0", "h:abc",
           "h:99999", "h:-1", "[::1]:5672", "[::1", "h]", "u:p@h:1:2", "ü:ß@h", "h" * 300,
           "u:" + "p" * 5000 + "@h", "%zz@h", "h?x", ""]


@pytest.mark.parametrize("scheme", sorted(set(BASES) - {"memory", "sql"}))
@pytest.mark.parametrize("netloc", NETLOCS)
def test_any_user_host_and_port_build_the_backend_or_are_refused_by_name(
        scheme: str, netloc: str) -> None:
    """The authority part too (a user without a password made pika raise a
    bare TypeError): building the backend works or is a ConfigurationError
    naming broker_url."""
    app = duebox.Duebox("sqlite://")
    refused = ""
    try:
        app.configure(broker_url=f"{scheme}://{netloc}/")
        app.broker()
    except ConfigurationError as exc:
        refused = str(exc)
    finally:
        app.dispose()
    assert not refused or "broker_url" in refused, refused
