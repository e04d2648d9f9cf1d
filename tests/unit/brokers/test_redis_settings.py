"""duebox.brokers.redis_settings: what a ``redis://`` URL says, and the URL
redis-py gets (duebox's own parameters taken out, the rest passed on)."""

from __future__ import annotations

import pytest

from duebox import ConfigurationError
from duebox.brokers.redis_settings import Keys, RedisSettings


def test_the_defaults() -> None:
    assert RedisSettings.from_url("redis://h") == RedisSettings(
        client_url="redis://h", prefix="duebox", horizon=3600.0, group="duebox",
        claim_idle=30.0)


def test_each_parameter_lands_in_its_field_and_the_rest_go_to_redis_py() -> None:
    s = RedisSettings.from_url("rediss://:pw@h:6380/2?prefix=app&horizon=60&socket_timeout=3"
                               "&group=g1&claim_idle=0.5&max_delay=10")
    assert (s.prefix, s.horizon, s.group, s.claim_idle) == ("app", 60.0, "g1", 0.5)
    assert s.client_url == "rediss://:pw@h:6380/2?socket_timeout=3"


@pytest.mark.parametrize(("url", "says"), [
    ("amqp://h", "must start with redis://"),
    ("redis://h?socket_timout=3", "unknown parameter 'socket_timout' for redis://"),
    ("redis://h?prefix=", "prefix must be a non-empty name without braces, colons or spaces"),
    ("redis://h?prefix=a{b}", "prefix must be a non-empty name"),
    ("redis://h?group=a:b", "group must be a non-empty name"),
    ("redis://h?group=a%20b", "group must be a non-empty name"),
    ("redis://h?horizon=-1", "horizon must be a number of seconds >= 0"),
    ("redis://h?claim_idle=0.01", "claim_idle must be a number of seconds >= 0.1"),
    ("redis://h?cluster=maybe", "cluster must be true or false"),
    ("redis://a:1,b:2?cluster=0", "several hosts are the seeds of a Redis Cluster"),
    ("redis://a:1,b:x", "'b:x' is not a host[:port]"),
    ("redis://a:1,,b:2", "'' is not a host[:port]"),
    ("redis://h/2?cluster=1", "a Redis Cluster has database 0 only"),
    ("redis://a:1,b:2/1", "a Redis Cluster has database 0 only"),
    # A connection parameter RedisCluster does not take would fail at the
    # first connection with a TypeError.
    ("redis://h?cluster=1&retry_on_timeout=1",
     "unknown parameter 'retry_on_timeout' for redis://"),
])
def test_a_bad_url_is_refused_naming_the_parameter(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisSettings.from_url(url)
    assert str(refused.value).startswith(f"broker_url: {says}")


def test_a_refused_url_does_not_show_its_password() -> None:
    with pytest.raises(ConfigurationError) as refused:
        RedisSettings.from_url("amqp://u:s3cret@h")
    assert "s3cret" not in str(refused.value)


def test_a_queues_keys_share_one_hash_tag() -> None:
    keys = Keys.of("app", "mail")
    assert keys == Keys("app:{mail}:due", "app:{mail}:msg", "app:{mail}:ready",
                        "app:{mail}:held", "app:{mail}:wake")
    assert Keys.of("app", "sms") != keys


def test_a_cluster_by_its_flag_or_by_several_hosts() -> None:
    one = RedisSettings.from_url("redis://h:7000?cluster=yes&prefix=app")
    assert (one.cluster, one.seeds, one.prefix) == (True, (("h", 7000),), "app")
    assert one.client_url == "redis://h:7000"
    many = RedisSettings.from_url("redis://:pw@a:7000,b,[::1]:7002/0?socket_timeout=3")
    assert many.cluster
    assert many.seeds == (("a", 7000), ("b", 6379), ("::1", 7002))
    # redis-py's URL names one host; the others become its startup nodes.
    assert many.client_url == "redis://:pw@a:7000/0?socket_timeout=3"
    assert not RedisSettings.from_url("redis://h?cluster=0").cluster
