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
An event whose exception has a cause (the database or a broker out of reach,
or refusing the connection: duebox.observability.causes) is not this logger's to write: it
goes to the process's registry (duebox.observability.trouble), which writes one line per
cause per interval across every logger, in duebox's words.
:meth:`CollapsedLog.flush` reports the repeats still uncounted once their
interval has passed with no further line to carry them (the relay calls it
after every pass), so a count is never lost to a quiet log.  Thread-safe:
the worker logs from its executor threads too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .collapsing import Windows
from .trouble import TROUBLES, cause_in


class CollapsedLog:
    """A logger's repeated events, one line per ``kind`` per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self._windows = Windows(interval, clock)

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
        # Trouble (a warning or worse) with a cause: the registry's line,
        # shared with every logger; routine news stays this logger's.
        cause = cause_in(exc_info, args) if level >= logging.WARNING else None
        if cause is not None:
            return TROUBLES.report(cause, self.logger, kind.split(":")[0], level)
        write, repeats, span, first = self._windows.admit(kind, (level, msg, args))
        if not write:
            return False
        if repeats:
            msg += " [%d more like this in %.0fs]"
            args = (*args, repeats, span)
        self.logger.log(level, msg, *args, exc_info=exc_info if first else None)
        return True

    def flush(self) -> None:
        """Write the counts of repeats not yet reported whose interval has
        passed (the condition ended before another event of its kind came to
        carry them).  Cheap when there are none: call it as often as you like."""
        TROUBLES.flush()
        for (level, msg, args), repeats, span in self._windows.due():
            self.logger.log(level, msg + " [%d like this in %.0fs]", *args, repeats, span)


class CollapsingFilter(logging.Filter):
    """The same for a library's own loggers (pika logs every failed
    connection attempt at ERROR, in some nine lines): records of one logger
    and message template pass once per ``interval``, the next one with the
    count of those held back; a traceback only the first time.  A logger's
    filter sees only the records made on that logger: add it to each one."""

    def __init__(self, interval: float = 30.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._windows = Windows(interval, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        write, repeats, span, first = self._windows.admit(f"{record.name}:{record.msg}", None)
        if not write:
            return False
        if repeats:
            record.msg = f"{record.getMessage()} [{repeats} more like this in {span:.0f}s]"
            record.args = None
        if not first:
            record.exc_info = record.exc_text = None
        return True


def collapse_library_logs(prefix: str, interval: float = 30.0) -> CollapsingFilter:
    """Add one :class:`CollapsingFilter` to every logger named ``prefix`` or
    ``prefix.*`` that exists now (import the library first); returns it."""
    collapsing = CollapsingFilter(interval)
    for name in [prefix, *(n for n in list(logging.root.manager.loggerDict)
                            if n.startswith(prefix + "."))]:
        logging.getLogger(name).addFilter(collapsing)
    return collapsing


def kind_of(exc: BaseException) -> str:
    """An exception's kind for collapsing: its class, with the cause's when
    duebox wrapped a driver's error (``BrokerError<ConnectionError>``)."""
    cause = exc.__cause__
    name = type(exc).__name__
    return f"{name}<{type(cause).__name__}>" if cause is not None else name


def job_fields(job: Any) -> dict[str, Any]:
    """The ``extra`` of a log line about one job: what ``--log-format json``
    writes as its fields (``job_id``, ``task``, ``queue``, ``attempt``)."""
    return {"job_id": str(job.id), "task": job.task, "queue": job.queue,
            "attempt": job.attempt}


def log_traced(logger: logging.Logger, level: int, traceback_text: str | None, msg: str,
               *args: Any, extra: dict[str, Any] | None = None) -> None:
    """Log ``msg`` with a traceback, as ``exc_info`` would, but one given as
    text: the worker's is bounded and masked like the payload (formatting
    the exception again would show what the task's mask hook hides).  Every
    formatter appends ``exc_text`` the way it appends a formatted exception."""
    if not logger.isEnabledFor(level):
        return
    fn, lno, func, _ = logger.findCaller(stacklevel=2)
    record = logger.makeRecord(logger.name, level, fn, lno, msg, args, None, func, extra)
    record.exc_text = traceback_text or None
    logger.handle(record)
