"""What a Redis Cluster's ``CLUSTER SHARDS`` says about data it may have
lost, for the ``redis://`` backend's reconciliation (``data_lost``).

Redis replicates asynchronously: a primary acknowledges a write before its
replica has it.  When the primary dies and the replica takes over, the
writes of the last moment are gone (a publish the relay already marked
``ENQUEUED``, a move of a parked job onto the stream).  A primary restarted
empty before anyone noticed (no persistence) lost its whole shard.  Either
way the shard's primary is a different node, or the same node with a
replication offset that went back: that is what :func:`shards_changed`
looks for, and the relay then reconciles at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: slot ranges (flattened: lo, hi, lo, hi, ...) -> (primary's node id, its
#: replication offset)
ShardView = dict[tuple[int, ...], tuple[str, int]]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(item: Any) -> dict[str, Any]:
    """A reply's map, whether redis-py made a dict of it or left the flat
    ``[key, value, key, value]`` list."""
    if isinstance(item, Mapping):
        return {_text(k): v for k, v in item.items()}
    pairs = list(item)
    return {_text(pairs[i]): pairs[i + 1] for i in range(0, len(pairs) - 1, 2)}


def _slots(raw: Any) -> tuple[int, ...]:
    flat: list[int] = []
    for part in raw or []:
        if isinstance(part, list | tuple):
            flat += [int(x) for x in part]
        else:
            flat.append(int(part))
    return tuple(flat)


def shard_view(reply: Any) -> ShardView:
    """Each shard that has slots and an online primary: its primary's id and
    replication offset.  A shard whose primary is failing is left out until
    a primary serves it again."""
    view: ShardView = {}
    for shard in reply or []:
        fields = _fields(shard)
        slots = _slots(fields.get("slots"))
        if not slots:
            continue
        for node in fields.get("nodes") or []:
            n = _fields(node)
            if _text(n.get("role", "")) == "master" and _text(n.get("health", "")) == "online":
                view[slots] = (_text(n.get("id", "")), int(n.get("replication-offset") or 0))
    return view


def shards_changed(seen: ShardView, now: ShardView) -> bool:
    """Whether a shard may have lost writes since ``seen``: it is served by
    another primary, its primary's offset went back, or it was not served
    when last seen (a failover was under way)."""
    for slots, (primary, offset) in now.items():
        before = seen.get(slots)
        if before is None or before[0] != primary or offset < before[1]:
            return True
    return False


__all__ = ["ShardView", "shard_view", "shards_changed"]
