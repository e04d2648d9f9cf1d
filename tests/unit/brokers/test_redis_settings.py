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
