"""duebox.brokers.redis_shards: when a cluster's shards say it may have lost
writes (a primary replaced, or its replication offset gone back).  The
failover itself, with a real cluster: tests/contract/test_redis.py and
tests/test_recovery.py."""

from __future__ import annotations

from typing import Any

from duebox.brokers.redis_shards import shard_view, shards_changed


def shard(slots: list[tuple[int, int]], *nodes: tuple[str, str, int, str]) -> dict[str, Any]:
    """As redis-py parses ``CLUSTER SHARDS`` (bytes keys inside nodes)."""
    return {"slots": slots, "nodes": [
        {b"id": i.encode(), b"role": role.encode(), b"replication-offset": off,
         b"health": health.encode()} for i, role, off, health in nodes]}


def test_each_shard_is_its_online_primary_and_offset() -> None:
    view = shard_view([
        shard([(0, 5460)], ("a", "master", 10, "online"), ("b", "replica", 9, "online")),
        # redis-py may also leave the flat list of the RESP2 reply.
        ["slots", [5461, 10922], "nodes", [["id", "c", "role", "master",
                                            "replication-offset", 5, "health", "online"]]],
        shard([(10923, 16383)], ("e", "master", 7, "fail"), ("f", "replica", 7, "online")),
        shard([], ("g", "master", 0, "online")),  # a primary with no slots serves nothing
    ])
    assert view == {(0, 5460): ("a", 10), (5461, 10922): ("c", 5)}


def test_a_replaced_primary_or_an_offset_gone_back_is_a_change() -> None:
    seen = {(0, 5460): ("a", 10), (5461, 16383): ("c", 5)}
    assert not shards_changed(seen, seen)
    assert not shards_changed(seen, {(0, 5460): ("a", 99), (5461, 16383): ("c", 5)})
    assert shards_changed(seen, {(0, 5460): ("b", 10), (5461, 16383): ("c", 5)})
    assert shards_changed(seen, {(0, 5460): ("a", 0), (5461, 16383): ("c", 5)})
    # Not served when last seen (its primary was failing): served again now.
    assert shards_changed({(0, 5460): ("a", 10)}, seen)
    # A shard failing now says nothing yet; the look after it is served again does.
    assert not shards_changed(seen, {(0, 5460): ("a", 10)})
