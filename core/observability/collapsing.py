"""The counting behind every collapsed log line (``logs``, ``trouble``):
per kind, when a line was last written and what was held back since.

A kind's first event is written at once; the repeats within ``interval``
seconds are counted, and the next event after it is written with that count.
:meth:`Windows.due` hands over the counts whose interval passed with no event
to carry them.  Thread-safe: the worker logs from its executor threads too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Kinds remembered at most (a kind that embeds a value must not grow this
# without bound): the oldest are forgotten first.
_MAX_KINDS = 512


@dataclass
class _Seen:
    since: float  # when the last line of this kind was written
    repeats: int = 0  # events since then, not written
    last: Any = None  # the latest of them, to write with the count when flushed


class Windows:
    """Per kind, when a line was last written and what was held back since."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self.interval = interval
        self.clock = clock
        self.kinds: dict[str, _Seen] = {}
        self.traced: set[str] = set()
        self.pending = False  # some kind holds repeats not yet written
        self.lock = threading.Lock()

    def admit(self, kind: str, last: Any) -> tuple[bool, int, float, bool]:
        """Whether to write this event now, how many were held back since the
        last line of its kind, over how long, and whether it is the kind's
        first line (which alone keeps its traceback)."""
        now = self.clock()
        with self.lock:
            seen = self.kinds.get(kind)
            if seen is not None and now - seen.since < self.interval:
                seen.repeats += 1
                seen.last = last
                self.pending = True
                return False, 0, 0.0, False
            repeats, since = (seen.repeats, seen.since) if seen is not None else (0, now)
            self.kinds.pop(kind, None)  # re-inserted last: the dict stays in age order
            self.kinds[kind] = _Seen(now)
            while len(self.kinds) > _MAX_KINDS:
                del self.kinds[next(iter(self.kinds))]
            first = kind not in self.traced
            if first:
                self.traced.add(kind)
                if len(self.traced) > _MAX_KINDS:
                    self.traced.clear()
            return True, repeats, now - since, first

    def due(self) -> list[tuple[Any, int, float]]:
        """The held-back events whose interval has passed with no line to
        carry their count: (latest event, count, span)."""
        if not self.pending:  # the common case: one attribute read
            return []
        now = self.clock()
        with self.lock:
            done = []
            for kind, seen in self.kinds.items():
                if seen.repeats and seen.last is not None and now - seen.since >= self.interval:
                    done.append((seen.last, seen.repeats, now - seen.since))
                    self.kinds[kind] = _Seen(now)
            self.pending = any(s.repeats for s in self.kinds.values())
        return done
