"""duebox.brokers.amqp_hosts: the nodes of a RabbitMQ cluster in one
``amqp://`` URL, split into one URL per node; bad lists refused.

That the broker moves to a surviving node when its own dies is
tests/test_amqp_cluster.py's (a real 3-node cluster)."""

from __future__ import annotations

import pytest

from duebox import ConfigurationError
from duebox.brokers.amqp_hosts import node_urls
from duebox.brokers.amqp_settings import AMQPSettings


def test_one_host_is_the_url_itself() -> None:
    url = "amqps://u:p@[::1]:5671/vh?heartbeat=5"
    assert node_urls(url) == [url]


def test_each_node_keeps_the_credentials_vhost_and_query_in_the_order_written() -> None:
    assert node_urls("amqp://u:p%40x@b:5673,a,[::1]:5674/vh?queue_type=quorum") == [
        "amqp://u:p%40x@b:5673/vh?queue_type=quorum",
        "amqp://u:p%40x@a/vh?queue_type=quorum",
        "amqp://u:p%40x@[::1]:5674/vh?queue_type=quorum",
    ]
    assert node_urls("amqp://a:1,b:2") == ["amqp://a:1", "amqp://b:2"]


@pytest.mark.parametrize(("url", "says"), [
    ("amqp://u:p@a,,b/", "node 2 of 'a,,b' is empty"),
    ("amqp://u:p@a,/", "node 2 of 'a,' is empty"),
    ("amqp://u:p@a,b:x/", "node 2 ('b:x') is not HOST or HOST:PORT with a port from 1 to 65535"),
    ("amqp://u:p@a,b:0/", "node 2 ('b:0') is not HOST or HOST:PORT"),
    ("amqp://u:p@a,b:70000/", "node 2 ('b:70000') is not HOST or HOST:PORT"),
    ("amqp://u:p@a,:5672/", "node 2 (':5672') is not HOST or HOST:PORT"),
    ("amqp://u:p@a:5672,A:5672/", "the node 'A:5672' is named twice"),
])
def test_a_bad_node_list_is_refused_naming_the_node(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        node_urls(url)
    assert str(refused.value).startswith(f"broker_url: {says}")
    with pytest.raises(ConfigurationError):  # the settings check it, without pika
        AMQPSettings.from_url(url)
