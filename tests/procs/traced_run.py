"""A relay and a worker traced with the OpenTelemetry SDK, in a process of
their own (a tracer provider is set once per process, and the test
session's other tests must not be traced).

    python tests/procs/traced_run.py DATABASE_URL BROKER_URL

Schedules ``effect``, ``flaky`` (fails its first attempt) and ``noop`` (with
a ``traceparent`` of its own) inside a ``request`` span, runs them to
SUCCEEDED, then prints one JSON object: the finished spans and the jobs'
stored headers.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import Running, job_row, make_app
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session

import duebox
from duebox import RetryPolicy

GIVEN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def shown(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name, "kind": span.kind.name, "trace": f"{ctx.trace_id:032x}",
        "id": f"{ctx.span_id:016x}",
        "parent": f"{span.parent.span_id:016x}" if span.parent else None,
        "links": [[f"{ln.context.trace_id:032x}", f"{ln.context.span_id:016x}"]
                  for ln in span.links],
        "attributes": dict(span.attributes or {}), "status": span.status.status_code.name,
    }


async def main(database_url: str, broker_url: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    app = make_app(database_url, broker_url)
    tries: list[int] = []

    @app.task("flaky", max_attempts=2, retry=RetryPolicy(base=0.05, cap=0.05))
    def flaky(payload: Any, ctx: duebox.JobContext) -> None:
        tries.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("upstream said no")

    tracer = trace.get_tracer("the-app")
    with tracer.start_as_current_span("request"), Session(app.engine) as s, s.begin():
        ids = {"effect": app.schedule(s, "effect", {"n": 1}, delay=0.3),
               "flaky": app.schedule(s, "flaky", None, delay=0.3),
               # A trace context of the caller's own: kept as given.
               "noop": app.schedule(s, "noop", None, delay=0.3,
                                    headers={"traceparent": GIVEN})}
    async with Running(app) as r:
        await r.wait(lambda: all(job_row(app.engine, i).state == "SUCCEEDED"
                                 for i in ids.values()), timeout=60, what="both jobs")
    print(json.dumps({
        "spans": [shown(s) for s in exporter.get_finished_spans()],
        "jobs": {k: {"id": str(v), "headers": job_row(app.engine, v).headers}
                 for k, v in ids.items()},
    }))
    app.dispose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
