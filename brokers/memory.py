"""``memory://NAME`` — an in-process broker for tests and benchmarks.

Like dramatiq's stub broker: relay and worker must share the process.  Each
URL name is one broker; delays are honoured with the event loop's timer, so a
message never becomes visible early.  Nothing survives the process.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .base import (
    BrokerContext,
    Capabilities,
    Delivery,
    Durability,
    Ordering,
    Outgoing,
    PublishingBroker,
    PublishResult,
)


@dataclass
class _Hub:
    queues: dict[str, asyncio.Queue[tuple[bytes, int]]] = field(
        default_factory=lambda: defaultdict(asyncio.Queue)
    )
    published: int = 0
    ids: itertools.count[int] = field(default_factory=itertools.count)


_HUBS: dict[str, _Hub] = {}


class MemoryBroker(PublishingBroker):
    capabilities = Capabilities(
        name="memory",
        max_delay=None,
        delay_precision=0.001,
        cancel=False,
        ordering=Ordering.DUE,
        ordering_note="per queue, in visibility order",
        durability=Durability.NONE,
        durability_note="none: in process memory only",
        payload_limit=None,
        redelivers_unacked=False,
        in_flight_after_cancel="delivered, then discarded by the version check",
    )

    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        name = urlsplit(url).netloc or "default"
        self.hub = _HUBS.setdefault(name, _Hub())

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        loop = asyncio.get_running_loop()
        results = []
        for out in batch:
            body = out.message.encode()
            queue = self.hub.queues[out.message.queue]
            mid = next(self.hub.ids)
            if out.delay > 0:
                loop.call_later(out.delay, queue.put_nowait, (body, mid))
            else:
                queue.put_nowait((body, mid))
            self.hub.published += 1
            results.append(PublishResult(out.message.job_id, True, str(mid)))
        return results

    async def consume(self, queues: Sequence[str], prefetch: int,
                      wanted: Callable[[], int] | None = None) -> AsyncIterator[Delivery]:
        names = list(queues) or ["default"]
        if len(names) == 1:
            q = self.hub.queues[names[0]]
            while True:
                body, mid = await q.get()
                yield self.delivery(body, mid)
        while True:
            for name in names:
                q = self.hub.queues[name]
                while not q.empty():
                    body, mid = q.get_nowait()
                    yield self.delivery(body, mid)
            await asyncio.sleep(0.001)

    async def defer(self, delivery: Delivery, seconds: float) -> bool:
        """Make the message visible again after ``seconds`` (it came early)."""
        if delivery.message is None:
            return True
        queue = self.hub.queues[delivery.message.queue]
        item = (delivery.message.encode(), delivery.raw)
        asyncio.get_running_loop().call_later(max(0.0, seconds), queue.put_nowait, item)
        return True

    async def inject(self, queue: str, body: bytes) -> None:
        """Put raw bytes on a queue, as a misbehaving producer would (tests)."""
        self.hub.queues[queue].put_nowait((body, next(self.hub.ids)))


def reset_hubs() -> None:
    _HUBS.clear()
