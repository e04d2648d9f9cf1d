"""OpenTelemetry tracing, optional: ``pip install duebox[otel]``.

Three spans per job, joined by the W3C trace context the job carries:

* **schedule** (``schedule <task>``, kind PRODUCER), when the application
  calls ``app.schedule``/``app.new_job``: a child of whatever span is
  current (a web request's).  Its context is written into the job's
  headers as ``traceparent`` (and ``tracestate``), so it is stored with the
  job in the outbox and travels in the message body and in the broker's
  own headers;
* **publish** (``publish``, kind PRODUCER), one per batch a relay hands to
  its broker, linked to each job's schedule span;
* **process** (``process <task>``, kind CONSUMER), one per attempt on the
  worker, *linked* to the schedule span rather than its child: a job may
  run hours after it was scheduled, and a trace that stays open for hours
  (and collects every retry) is not what a request's trace should be.  It
  is the current span while an ``async def`` handler runs, so the
  handler's own spans nest under it.

duebox never imports OpenTelemetry first: tracing is on when the
application has imported ``opentelemetry.trace`` and set a tracer provider
(an SDK's).  Without the extra, or with the API but no provider, nothing is
imported (or nothing is made) and nothing changes: no span, no header.  A ``traceparent`` the
caller put in ``headers=`` is kept as it is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Link, Span, Tracer

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
_SCOPE = "duebox"
_SYSTEM = "duebox"
# A batch publish links at most this many jobs (OpenTelemetry SDKs drop
# links beyond 128 by default).
_MAX_LINKS = 128


@functools.lru_cache(maxsize=1)
def _tracer() -> Tracer:
    # A proxy until the application sets its provider, then that provider's
    # tracer: safe to keep, and cheaper than a look-up per job.
    from opentelemetry import trace

    return trace.get_tracer(_SCOPE)


def enabled() -> bool:
    """Whether spans would be recorded: the application has imported
    OpenTelemetry's API and configured a tracer provider (an SDK's).  The
    API alone (FastAPI imports it, for one) has only no-op spans: duebox
    then makes none and stores no header."""
    if "opentelemetry.trace" not in sys.modules:
        return False
    from opentelemetry import trace

    return not isinstance(trace.get_tracer_provider(),
                          trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def stamp(headers: dict[str, Any] | None, task: str, queue: str) -> dict[str, Any] | None:
    """``headers`` with the context of a new schedule span for ``task``
    (the span ends at once: it marks the moment the job was written into
    the caller's transaction).  Unchanged when tracing is off, when no
    tracer provider records, or when the caller gave a ``traceparent``."""
    if not enabled() or (headers is not None and TRACEPARENT in headers):
        return headers
    from opentelemetry import propagate, trace

    span = _tracer().start_span(f"schedule {task}", kind=trace.SpanKind.PRODUCER, attributes={
        "messaging.system": _SYSTEM, "messaging.operation.type": "create",
        "messaging.destination.name": queue, "duebox.task": task})
    try:
        if not span.get_span_context().is_valid:
            return headers  # a provider that records nothing: nothing to store
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
    finally:
        span.end()
    found = {k: v for k, v in carrier.items() if k in TRACE_HEADERS}
    if not found:
        return headers
    return {**(headers or {}), **found}


def _links(headers_of: Sequence[Mapping[str, Any] | None]) -> list[Link]:
    from opentelemetry import propagate, trace

    links = []
    for headers in headers_of:
        if not headers or TRACEPARENT not in headers:
            continue
        carrier = {k: str(headers[k]) for k in TRACE_HEADERS if k in headers}
        ctx = trace.get_current_span(propagate.extract(carrier)).get_span_context()
        if ctx.is_valid:
            links.append(trace.Link(ctx))
            if len(links) >= _MAX_LINKS:
                break
    return links


@contextmanager
def publish_span(headers_of: Sequence[Mapping[str, Any] | None], backend: str
                 ) -> Iterator[Span | None]:
    """The span of one batch publish by a relay, linked to its jobs'
    schedule spans; None when tracing is off."""
    if not enabled():
        yield None
        return
    from opentelemetry import trace

    with _tracer().start_as_current_span(
            "publish", kind=trace.SpanKind.PRODUCER, links=_links(headers_of), attributes={
                "messaging.system": _SYSTEM, "messaging.operation.type": "send",
                "messaging.batch.message_count": len(headers_of),
                "duebox.broker": backend}) as span:
        yield span


@contextmanager
def attempt_span(task: str, queue: str, job_id: object, attempt: int,
                 headers: Mapping[str, Any] | None) -> Iterator[Span | None]:
    """The span of one attempt on the worker, linked to the job's schedule
    span and current while it runs; None when tracing is off.  The caller
    reports the outcome with :func:`outcome`."""
    if not enabled():
        yield None
        return
    from opentelemetry import trace

    with _tracer().start_as_current_span(
            f"process {task}", kind=trace.SpanKind.CONSUMER, links=_links([headers]),
            record_exception=True, attributes={
                "messaging.system": _SYSTEM, "messaging.operation.type": "process",
                "messaging.destination.name": queue, "messaging.message.id": str(job_id),
                "duebox.task": task, "duebox.attempt": attempt}) as span:
        yield span


def outcome(span: Span | None, status: str, error: str | None) -> None:
    """Record an attempt's outcome (``succeeded``, ``retried``, ``dead`` ...)
    on its span: an error status with the failure's text when it failed."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("duebox.outcome", status)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error[:500]))


__all__ = ["TRACEPARENT", "TRACESTATE", "TRACE_HEADERS", "attempt_span", "enabled", "outcome",
           "publish_span", "stamp"]
