"""duebox.brokers.amqp_settings: what an ``amqp://`` URL says, checked
without pika."""

from __future__ import annotations

import pytest

from duebox import ConfigurationError
from duebox.brokers.amqp_pack import DEFAULT_PACK, MAX_PACK_JOBS
from duebox.brokers.amqp_settings import AMQPSettings
from duebox.brokers.amqp_topology import Topology


def test_the_defaults() -> None:
    s = AMQPSettings.from_url("amqp://guest:guest@h/")
    assert s == AMQPSettings(topology=Topology(), delay_mode="auto", confirm_timeout=30.0,
                             pack=DEFAULT_PACK)
    assert s.plugin is None  # detected at connect


def test_each_parameter_lands_in_its_field() -> None:
    s = AMQPSettings.from_url("amqps://u:p@h/vh?prefix=app&queue_type=quorum&delay_mode=tiers"
                              f"&pack={MAX_PACK_JOBS}&confirm_timeout=2.5&heartbeat=5")
    assert s.topology == Topology(prefix="app", queue_type="quorum")
    assert (s.delay_mode, s.pack, s.confirm_timeout, s.plugin) == (
        "tiers", MAX_PACK_JOBS, 2.5, False)
    assert AMQPSettings.from_url("amqp://h/?delay_mode=plugin").plugin is True


@pytest.mark.parametrize(("url", "says"), [
    ("amqp://h/?delay_mode=ttl", "delay_mode must be one of auto, tiers, plugin"),
    ("amqp://h/?pack=0", "pack must be an integer >= 1"),
    (f"amqp://h/?pack={MAX_PACK_JOBS + 1}", "pack must be an integer >= 1"),
    ("amqp://h/?pack=2.5", "pack must be an integer"),
    ("amqp://h/?confirm_timeout=0", "confirm_timeout must be a number of seconds > 0"),
    ("amqp://h/?prefix=a%20b", "prefix must be 1-100 characters"),
    ("amqp://h/?queue_type=stream", "queue_type must be one of classic, quorum"),
])
def test_a_bad_url_is_refused_naming_the_parameter(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        AMQPSettings.from_url(url)
    assert str(refused.value).startswith(f"broker_url: {says}")
