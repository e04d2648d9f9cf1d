"""The process's trouble: one line per cause per interval, whichever of
duebox's loggers meets it, and refusals that end the relay or the worker.

A database outage reaches a relay through its passes, its LISTEN
connection, its heartbeat and its liveness lock, and a worker through its
deliveries, its batch lane and the same two: a 12 s PostgreSQL cut wrote
about 30 lines from 5 loggers, several of them 3 lines long with the
driver's text and a link.  Each of those places reports to :data:`TROUBLES`
instead (through :class:`duebox.observability.logs.CollapsedLog`, or :func:`log_trouble`
where it logs plainly); the cause (duebox.observability.causes) is the key, so the first
report writes one line in duebox's words, and the rest of the interval is
counted into the next one::

    database unreachable at 127.0.0.1:5432: Connection refused (heartbeat);
        retrying until it answers
    ... [57 more like this in 30s]   (on one line)

A refusal (a wrong password, an unknown vhost, database or role) is said
nothing of for a short grace, :data:`GRACE_SECONDS` over at least
:data:`GRACE_ATTEMPTS` reports, since a server still starting refuses for a
moment; after it, :meth:`Troubles.final` is true, and the places that
connect at start (``open_broker``, the CLI's wait for its database) raise
:class:`~duebox.errors.AccessRefusedError`: the ``duebox`` command ends with
that one line and exit status 78.  Used as a library, the refusal is logged
at ERROR once per interval and retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .causes import Cause, cause_of
from .collapsing import Windows

# A refusal must go on this long, over this many reports, before it is
# taken as final: RabbitMQ loading its definitions, or PostgreSQL starting,
# refuses a login for a moment.
GRACE_SECONDS = 5.0
GRACE_ATTEMPTS = 3


@dataclass
class _Refusal:
    first: float
    last: float
    reports: int = 1


class Troubles:
    """The collapsing windows of every cause, shared by all loggers."""

    def __init__(self, interval: float = 30.0, *, clock: Callable[[], float] = time.monotonic,
                 grace: float = GRACE_SECONDS, attempts: int = GRACE_ATTEMPTS) -> None:
        self.clock = clock
        self.grace = grace
        self.attempts = attempts
        self._windows = Windows(interval, clock)
        self._refusals: dict[str, _Refusal] = {}

    def report(self, cause: Cause, logger: logging.Logger, where: str,
               level: int = logging.WARNING, *, then: str = "retrying until it answers",
               stops: bool = False) -> bool:
        """One more event of ``cause``, met by ``where`` (what failed: "relay
        pass", "heartbeat"): written on ``logger``, followed by ``then``, if
        it is the first of its interval; True if written.  ``stops``: the
        caller ends the process once :meth:`final` (its own line says why):
        a refusal past the grace writes nothing here then."""
        if cause.permanent:
            if not self._refused(cause):
                logger.debug("%s (%s); within the grace", cause.text, where)
                return False
            if stops:
                return False
            level = max(level, logging.ERROR)
        if not logger.isEnabledFor(level):
            return False
        line = f"{cause.text} ({where}); {then}"
        write, repeats, span, _ = self._windows.admit(cause.key, (logger, level, line))
        if not write:
            return False
        suffix = f" [{repeats} more like this in {span:.0f}s]" if repeats else ""
        logger.log(level, "%s%s", line, suffix)
        return True

    def final(self, cause: Cause) -> bool:
        """Whether ``cause`` is a refusal that outlasted the grace (counted
        by :meth:`report`)."""
        with self._windows.lock:
            seen = self._refusals.get(cause.key)
            return (cause.permanent and seen is not None and seen.reports >= self.attempts
                    and seen.last - seen.first >= self.grace)

    def _refused(self, cause: Cause) -> bool:
        now = self.clock()
        with self._windows.lock:
            seen = self._refusals.get(cause.key)
            if seen is None or now - seen.last > self._windows.interval:  # a new episode
                self._refusals[cause.key] = _Refusal(now, now)
            else:
                seen.last, seen.reports = now, seen.reports + 1
        return self.final(cause)

    def ended(self, cause: Cause) -> str:
        """The one line of a process that stops on ``cause``."""
        with self._windows.lock:
            seen = self._refusals.get(cause.key)
            span = 0.0 if seen is None else seen.last - seen.first
            reports = 0 if seen is None else seen.reports
        return f"{cause.text} (refused {reports} times over {span:.0f} s: not retried)"

    def flush(self) -> None:
        """Write the counts held back whose interval has passed (the trouble
        ended before another report came to carry them); cheap when none."""
        for (logger, level, line), repeats, span in self._windows.due():
            logger.log(level, "%s [%d like this in %.0fs]", line, repeats, span)


# The process's one registry: every logger's reports meet here.
TROUBLES = Troubles()


def cause_in(exc_info: object, args: tuple[object, ...]) -> Cause | None:
    """The cause of the exception a log call carries (as ``exc_info`` or
    among its arguments), if it has one."""
    for candidate in (exc_info, *args):
        if isinstance(candidate, BaseException):
            return cause_of(candidate)
    return None


def log_trouble(logger: logging.Logger, where: str, exc: BaseException, msg: str,
                *args: object, level: int = logging.WARNING) -> bool:
    """Log ``msg`` about ``exc`` as usual, unless ``exc`` has a cause: then
    the registry's line for it (at most one per interval).  True if it had."""
    cause = cause_of(exc)
    if cause is None:
        logger.log(level, msg, *args)
        return False
    TROUBLES.report(cause, logger, where, level)
    return True


__all__ = ["GRACE_ATTEMPTS", "GRACE_SECONDS", "TROUBLES", "Cause", "Troubles", "cause_in",
           "cause_of", "log_trouble"]
