"""Repeated log lines, collapsed: one line per kind of event per interval, with a count.

An outage makes every delivery, pass and poll fail the same way, many times a
second; logging each one buries the line that matters (a 6 s database outage
wrote ~12,000 traceback lines, an 8 s AMQP cut ~1,400).  A
:class:`CollapsedLog` logs the first event of a kind at once, counts the
repeats within ``interval`` seconds, and logs the next one after the interval
with that count::

    relay pass failed (database unreachable ...); retrying in 0.2s
    relay pass failed (database unreachable ...); retrying in 10.0s [41 more like this in 30s]

A traceback (``exc_info``) is written the first time a kind is logged only.
:meth:`CollapsedLog.flush` reports the repeats still uncounted when the
condition ends (the relay calls it after a pass that succeeded), so the
count is never lost to a quiet log.  Thread-safe: the worker logs from its
executor threads too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Kinds remembered at most (a kind that embeds a value must not grow this
# without bound): the oldest are forgotten first.
_MAX_KINDS = 512


@dataclass
class _Seen:
    since: float  # when the last line of this kind was written
    repeats: int = 0  # events since then, not written
    last: tuple[int, str, tuple[object, ...]] | None = None  # the latest of them


class CollapsedLog:
    """A logger's repeated events, one line per ``kind`` per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._kinds: dict[str, _Seen] = {}
        self._traced: set[str] = set()
        self._pending = False  # some kind holds repeats not yet written
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object,
                exc_info: BaseException | bool | None = None) -> bool:
        return self.log(logging.WARNING, kind, msg, *args, exc_info=exc_info)

    def error(self, kind: str, msg: str, *args: object,
              exc_info: BaseException | bool | None = None) -> bool:
        return self.log(logging.ERROR, kind, msg, *args, exc_info=exc_info)

    def info(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object,
            exc_info: BaseException | bool | None = None) -> bool:
        """Write the event, or count it if one of its kind was written less
        than ``interval`` seconds ago; True if written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen.since < self.interval:
                seen.repeats += 1
                seen.last = (level, msg, args)
                self._pending = True
                return False
            repeats, since = (seen.repeats, seen.since) if seen is not None else (0, now)
            self._kinds.pop(kind, None)  # re-inserted last: the dict stays in age order
            self._kinds[kind] = _Seen(now)
            while len(self._kinds) > _MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]
            trace = exc_info if kind not in self._traced else None
            if trace:
                self._traced.add(kind)
                if len(self._traced) > _MAX_KINDS:
                    self._traced.clear()
        if repeats:
            msg += " [%d more like this in %.0fs]"
            args = (*args, repeats, now - since)
        self.logger.log(level, msg, *args, exc_info=trace)
        return True

    def flush(self) -> None:
        """Write the counts of repeats not yet reported (the condition ended
        before another event of its kind came to carry them)."""
        if not self._pending:  # the common case: one attribute read
            return
        now = self._clock()
        with self._lock:
            done = [(s.last, s.repeats, now - s.since) for s in self._kinds.values()
                    if s.repeats and s.last is not None]
            for kind, seen in self._kinds.items():
                if seen.repeats:
                    self._kinds[kind] = _Seen(now)
            self._pending = False
        for (level, msg, args), repeats, span in done:
            self.logger.log(level, msg + " [%d like this in %.0fs]", *args, repeats, span)


def kind_of(exc: BaseException) -> str:
    """An exception's kind for collapsing: its class, with the cause's when
    duebox wrapped a driver's error (``BrokerError<ConnectionError>``)."""
    cause = exc.__cause__
    name = type(exc).__name__
    return f"{name}<{type(cause).__name__}>" if cause is not None else name
