"""Per-queue broker routing: which broker each queue's jobs go through.

``broker_url`` is the default route; ``broker_routes`` maps queue names to
other broker URLs (``DUEBOX_BROKER_ROUTES``: ``emails=sqs://...,payments=
amqp://...``, or the same as a JSON object).  Queues routed to the same URL
share one backend; a route to the default URL is the default route.

:class:`Routes` answers the three questions the rest asks: which URL serves
a queue (producer checks, workers), which queues a broker serves (one relay
pipeline per publishing broker, one consumer per broker in a worker), and the
SQL condition a relay pipeline's claims carry so that it claims only its
own queues.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, select

from .credentials import redacted
from .errors import ConfigurationError, ValidationError
from .message import too_deep
from .registry import broker_class, check_broker_url, check_queue_name
from .states import JobState
from .tables import job

FIELD = "broker_routes"

# An entry starts where a comma is followed by ``queue=scheme://``: a comma
# inside a URL (Kafka's ``kafka://a:9092,b:9092``) is not followed by that.
_ENTRY = re.compile(r",(?=\s*[^,=\s]+\s*=\s*[A-Za-z][A-Za-z0-9+.-]*://)")


def parse_routes(value: Mapping[str, str] | str | None) -> dict[str, str]:
    """``queue -> broker URL`` from a mapping, a JSON object, or the text
    form ``queue=URL,queue=URL``; raises :class:`ConfigurationError` naming
    the entry and the rule.  The URLs' schemes and queue names are checked
    by :func:`check_routes`."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            if too_deep(text, 1):  # counted unparsed: json recurses once per level
                raise ConfigurationError(f"{FIELD}: must be a JSON object of queue name to "
                                         "broker URL string, with nothing nested in it")
            try:
                value = json.loads(text, object_pairs_hook=_once_each)
            except ValueError as exc:
                raise ConfigurationError(f"{FIELD}: not a JSON object ({exc})") from None
        else:
            return _parse_text(text)
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{FIELD}: must be a mapping of queue name to broker URL, "
                                 f"a JSON object, or 'queue=URL,queue=URL' "
                                 f"(got {type(value).__name__})")
    routes: dict[str, str] = {}
    for queue, url in value.items():
        if not isinstance(queue, str) or not isinstance(url, str) or not url.strip():
            got = repr(url) if isinstance(url, str) else type(url).__name__
            raise ConfigurationError(f"{FIELD}: queue {queue!r}: must map a queue name to a "
                                     f"non-empty broker URL string (got {got})")
        routes[queue] = url.strip()
    return routes


def _parse_text(text: str) -> dict[str, str]:
    routes: dict[str, str] = {}
    for n, entry in enumerate(_ENTRY.split(text), 1):
        queue, sep, url = entry.partition("=")
        queue, url = queue.strip(), url.strip()
        if not sep or not queue or not url:
            raise ConfigurationError(
                f"{FIELD}: entry {n} ({redacted(entry.strip())!r}) must be queue=URL, e.g. "
                "emails=sqs://...,payments=amqp://... (queue names with '=' or ',': "
                "give a JSON object)")
        if queue in routes:
            raise _routed_twice(queue)
        routes[queue] = url
    return routes


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a key given twice (``json`` would
    keep the last one, silently)."""
    members: dict[str, Any] = {}
    for key, value in pairs:
        if key in members:
            raise _routed_twice(key)
        members[key] = value
    return members


def _routed_twice(queue: str) -> ConfigurationError:
    return ConfigurationError(f"{FIELD}: queue {queue!r}: routed twice; give each queue "
                              "one broker URL")


def check_routes(routes: Mapping[str, str]) -> None:
    """Each route's URL must name a known backend (and a valid
    ``?max_delay=``) that outlives this process, and its queue must be a
    name that backend can use."""
    for queue, url in routes.items():
        try:
            check_broker_url(url)
            check_queue_name(url, queue)
            caps = broker_class(url).capabilities
            # Durability.NONE: seam.py is not imported here (its Settings
            # annotation would close an import cycle); a StrEnum equals its value.
            if caps.durability == "none":
                raise ConfigurationError(
                    f"{caps.name}:// keeps messages in one process's memory, where a worker "
                    "of another process never finds them: route the queue to a broker "
                    f"({caps.name}:// serves as broker_url only, in tests)")
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"{FIELD}: queue {queue!r} -> {redacted(url)}: "
                f"{str(exc).removeprefix('broker_url: ')}") from None
        except ValidationError as exc:
            raise ConfigurationError(
                f"{FIELD}: queue {queue!r} -> {redacted(url)}: not a queue name this broker "
                f"can use ({exc.rule})") from None


@dataclass(frozen=True)
class Route:
    """One broker and the queues it serves.  The default route serves every
    queue not routed elsewhere (``others``); a routed one exactly
    ``queues``."""

    url: str
    queues: tuple[str, ...] = ()
    others: tuple[str, ...] = ()
    default: bool = False

    def covers(self, queue: str) -> bool:
        return queue not in self.others if self.default else queue in self.queues

    def where(self) -> ColumnElement[bool] | None:
        """The condition a claim for this route adds (None: every queue)."""
        if self.default:
            return job.c.queue.not_in(list(self.others)) if self.others else None
        return job.c.queue.in_(list(self.queues))

    @property
    def label(self) -> str:
        """The route as people read it: its URL without a password."""
        return redacted(self.url)


@dataclass(frozen=True)
class Routes:
    """The app's routing: ``default`` (``broker_url``) and ``routed``
    (queue -> URL, only queues whose URL differs from the default)."""

    default: str
    routed: Mapping[str, str]

    @classmethod
    def of(cls, default: str, routes: Mapping[str, str] | None) -> Routes:
        return cls(default, {q: u for q, u in (routes or {}).items() if u != default})

    @property
    def active(self) -> bool:
        """Whether any queue goes through another broker than the default."""
        return bool(self.routed)

    def url_for(self, queue: str) -> str:
        return self.routed.get(queue, self.default)

    def all(self) -> list[Route]:
        """Every route, the default first, then by URL in the order routed."""
        urls: dict[str, list[str]] = {}
        for queue, url in self.routed.items():
            urls.setdefault(url, []).append(queue)
        routes = [Route(self.default, others=tuple(self.routed), default=True)]
        routes += [Route(url, queues=tuple(qs)) for url, qs in urls.items()]
        return routes

    def split(self, queues: Iterable[str]) -> dict[str, list[str]]:
        """``queues`` grouped by the URL that serves them, in first-seen order."""
        by_url: dict[str, list[str]] = {}
        for q in queues:
            by_url.setdefault(self.url_for(q), []).append(q)
        return by_url


def next_due(conn: Connection, where: ColumnElement[bool] | None) -> datetime | None:
    """The earliest ``due_at`` among ``SCHEDULED`` jobs matching ``where``
    (a route's queues): when a route's claim next finds a row.  Another
    route's due jobs must not wake a relay's pipeline: one whose broker is
    down leaves its jobs due, and would keep every other pipeline busy
    claiming nothing."""
    cond: Any = job.c.state == JobState.SCHEDULED
    if where is not None:
        cond = and_(cond, where)
    result: datetime | None = conn.execute(
        select(job.c.due_at).where(cond).order_by(job.c.due_at).limit(1)).scalar()
    return result


def describe(routes: Sequence[Route]) -> list[str]:
    """One line per route, for logs: ``queues -> URL`` (passwords hidden)."""
    return [("(default) " if r.default else ", ".join(r.queues) + " ") + "-> " + r.label
            for r in routes]


__all__ = ["Route", "Routes", "check_routes", "describe", "next_due", "parse_routes"]
