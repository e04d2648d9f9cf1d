"""Broker backends by URL scheme: the registry the floor above fills.

core imports no backend (the floors, docs/design.md "Where things live"):
duebox.brokers.schemes, which the package ``duebox`` imports, registers each
built-in backend with a function that imports its module when first asked,
so no driver is imported until its backend is used.  Register your own with
:func:`register_broker`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .credentials import check_userinfo, redacted
from .errors import ConfigurationError, ValidationError

# A backend's class, imported when the function is called (each time: an
# import statement finds a loaded module in sys.modules at once).
Backend = Callable[[], Any]
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")

_SCHEMES: dict[str, Backend] = {}
_routed: Backend | None = None  # the broker over several routes


def register_broker(scheme: str, backend: Backend) -> None:
    """Serve ``scheme://`` URLs with the class ``backend()`` returns, called
    when a URL of that scheme is first checked or opened (import your
    module inside it, so an app that never uses the scheme never imports
    its driver)::

        def nats() -> type[Broker]:
            from mypkg.nats import NatsBroker
            return NatsBroker

        duebox.registry.register_broker("nats", nats)
    """
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
        raise ConfigurationError("register_broker: scheme must be a URL scheme: a letter, "
                                 f"then letters, digits, '+', '-' or '.' (got {scheme!r})")
    if not callable(backend):
        raise ConfigurationError(f"register_broker: backend must be a function returning the "
                                 f"backend's class (got {backend!r})")
    _SCHEMES[scheme.lower()] = backend
    _check_for_backend.cache_clear()


def register_routed_broker(backend: Backend) -> None:
    """The broker that consumes several routes at once (a worker's queues
    spread over several brokers), resolved like the backends when first
    used: duebox.brokers.schemes registers brokers/routed.py's."""
    global _routed
    _routed = backend


def routed_broker_class() -> Any:
    if _routed is None:
        raise ConfigurationError("no broker over several routes is registered: "
                                 "duebox.brokers.schemes registers it, on import duebox")
    return _routed()


def schemes() -> list[str]:
    """The URL schemes a backend is registered for, sorted."""
    return sorted(_SCHEMES)


def broker_class(url: str) -> Any:
    try:
        scheme = urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    except ValueError as exc:  # an unbalanced IPv6 bracket, ...
        raise ConfigurationError(
            f"broker_url: not a URL ({exc}): {redacted(url)[:200]!r}") from None
    if not scheme:
        raise ConfigurationError(
            f"broker_url: must start with a scheme, one of {', '.join(schemes())}:// "
            f"(got {redacted(url) if isinstance(url, str) else url!r})"
        )
    backend = _SCHEMES.get(scheme)
    if backend is None:
        raise ConfigurationError(
            f"broker_url: unknown scheme {scheme!r}; known: "
            f"{', '.join(s + '://' for s in schemes())}"
        )
    return backend()


def check_broker_url(url: str) -> None:
    """Fail now, not when a relay starts, on an unknown scheme or a bad
    ``?max_delay=`` (what each backend accepts beyond that it checks itself
    when built), and on a user or password the clients would misread."""
    cls = broker_class(url)
    check_userinfo("broker_url", url)
    effective_max_delay(cls.capabilities.max_delay, dict(parse_qsl(urlsplit(url).query)))


def effective_max_delay(native: float | None, params: dict[str, str]) -> float | None:
    """The backend's ceiling, lowered by ``?max_delay=SECONDS`` when given."""
    raw = params.get("max_delay")
    if raw is None:
        return native
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(
            f"broker_url: max_delay must be a number of seconds >= 0 (got {raw!r})"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise ConfigurationError(
            f"broker_url: max_delay must be a number of seconds >= 0 (got {raw!r})"
        )
    if native is not None and value > native:
        raise ConfigurationError(
            f"broker_url: max_delay={raw} exceeds this backend's ceiling of {native:g} s"
        )
    return value


QUEUE_NAME_MAX = 200  # the job table's queue column


def check_queue_name(url: str, name: object) -> None:
    """Refuse, with :class:`ValidationError` naming ``queue``, a queue name the
    backend of ``url`` cannot use: every backend's rule (a non-empty string of
    at most 200 printable characters: no control, format or surrogate
    characters), then the backend's own (``Broker.check_queue_name``: AMQP
    wildcards and name lengths, SQS and Kafka character sets, Redis hash
    tags).  Called when a task is registered and when a job is scheduled, so
    an unusable name fails in the caller's hands, not in the relay after the
    commit.  Checks no broker over the network; a name once accepted for a
    URL is remembered."""
    if not isinstance(name, str) or not name or len(name) > QUEUE_NAME_MAX:
        raise ValidationError("queue", f"must be a non-empty string of at most "
                              f"{QUEUE_NAME_MAX} characters", name)
    _check_for_backend(url, name)


@functools.lru_cache(maxsize=1024)
def _check_for_backend(url: str, name: str) -> None:
    if not name.isprintable():
        raise ValidationError("queue", "must be printable text (no control, format or "
                              "surrogate characters)", name)
    broker_class(url).check_queue_name(url, name)


# Room left in a broker's message for the envelope around the payload: id,
# task and queue names (up to 200 characters each), version, times, and the
# duebox-* headers/attributes that some brokers count against the same limit.
ENVELOPE_ALLOWANCE = 2048


def message_limit(url: str, configured: int) -> tuple[int, str]:
    """The payload-plus-headers size a job may have on this broker: the
    configured ``max_payload_bytes``, lowered to what the backend's message
    limit (``?max_message_size=`` where it has one) leaves after the envelope."""
    cls = broker_class(url)
    native = cls.capabilities.payload_limit
    raw = dict(parse_qsl(urlsplit(url).query)).get("max_message_size")
    if raw is not None and raw.isdigit():
        native = int(raw)
    if native is not None and native - ENVELOPE_ALLOWANCE < configured:
        scheme = urlsplit(url).scheme.lower()
        return max(0, native - ENVELOPE_ALLOWANCE), (
            f"the {scheme}:// message limit of {native} bytes less {ENVELOPE_ALLOWANCE} "
            "for the envelope")
    return configured, "max_payload_bytes"
