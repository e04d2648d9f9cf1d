"""OpenTelemetry tracing (issue #22 item 9, duebox.observability.tracing): a schedule span
whose context the job stores in its headers, the relay's publish span and
one process span per attempt linked to it, on a real relay and worker with
the SDK's in-memory exporter (in a process of their own: a tracer provider
is set once per process); and nothing at all without OpenTelemetry."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backends import Keys
from conftest import reset_tables

from duebox.message import JobMessage

HERE = Path(__file__).resolve().parent


def traced_run(database_url: str, broker_url: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(HERE / "procs" / "traced_run.py"), database_url,
                           broker_url], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def check_trace(run: dict[str, Any], *, publishes: bool) -> None:
    spans = run["spans"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    (request,) = by_name["request"]
    for task in ("effect", "flaky"):
        (made,) = by_name[f"schedule {task}"]
        # A child of the application's span, in its trace ...
        assert (made["kind"], made["trace"], made["parent"]) == (
            "PRODUCER", request["trace"], request["id"])
        # ... whose context the job stores in its headers.
        job = run["jobs"][task]
        version, trace_id, span_id, _flags = job["headers"]["traceparent"].split("-")
        assert (version, trace_id, span_id) == ("00", made["trace"], made["id"])
        attempts = sorted(by_name[f"process {task}"], key=lambda s: s["attributes"]
                          ["duebox.attempt"])
        for s in attempts:
            assert s["kind"] == "CONSUMER"
            assert s["links"] == [[made["trace"], made["id"]]]
            assert s["attributes"]["messaging.message.id"] == job["id"]
        outcomes = [(s["attributes"]["duebox.outcome"], s["status"]) for s in attempts]
        assert outcomes == ([("succeeded", "UNSET")] if task == "effect" else
                            [("retried", "ERROR"), ("succeeded", "UNSET")])
    # A traceparent the caller gave is kept, and its attempt links to it.
    given = run["jobs"]["noop"]["headers"]["traceparent"]
    assert given == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert "schedule noop" not in by_name
    (ran,) = by_name["process noop"]
    assert ran["links"] == [["0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"]]
    published = by_name.get("publish", [])
    if not publishes:
        assert published == []  # sql:// workers claim from the job table: no publish
        return
    linked = {tuple(link) for s in published for link in s["links"]}
    for task in ("effect", "flaky"):
        (made,) = by_name[f"schedule {task}"]
        assert (made["trace"], made["id"]) in linked
    assert all(s["kind"] == "PRODUCER" for s in published)
    # A retry is published again: 3 jobs, 4 publications at least.
    assert sum(s["attributes"]["messaging.batch.message_count"] for s in published) >= 4


def test_traced_on_sql(database_url: str) -> None:
    check_trace(traced_run(database_url, "sql://"), publishes=False)


def test_traced_on_redis(tmp_path: Path, redis_keys: Keys) -> None:
    url = f"sqlite:///{tmp_path}/traced.db"
    reset_tables(url)
    check_trace(traced_run(url, redis_keys.url()), publishes=True)


def test_the_trace_context_travels_in_broker_headers() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    msg = JobMessage(uuid.uuid4(), "t", "q", 1, 1, datetime(2030, 1, 1, tzinfo=UTC),
                     headers={"traceparent": parent, "tracestate": "k=v", "other": 1})
    headers = msg.header_map()
    assert (headers["traceparent"], headers["tracestate"]) == (parent, "k=v")
    assert "other" not in headers
    assert "traceparent" not in JobMessage(uuid.uuid4(), "t", "q", 1, 1,
                                           datetime(2030, 1, 1, tzinfo=UTC)).header_map()


NOTHING = """
import sys
import duebox
from duebox.consumers import Worker
from duebox.relay import Relay
from duebox.tables import job
from sqlalchemy import select
from sqlalchemy.orm import Session

app = duebox.Duebox(sys.argv[1], "sql://")
app.task("t")(lambda p, c: None)
with Session(app.engine) as s, s.begin():
    job_id = app.schedule(s, "t", {"a": 1}, headers={"h": 1})
    other = app.schedule(s, "t", None)
    rows = dict(s.execute(select(job.c.id, job.c.headers)).all())
assert rows == {job_id: {"h": 1}, other: None}, rows
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
assert loaded == [], loaded
print("ok")
"""


def test_without_opentelemetry_nothing_is_imported_and_nothing_changes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/plain.db"
    reset_tables(url)
    done = subprocess.run([sys.executable, "-c", NOTHING, url], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_api_alone_makes_no_span(tmp_path: Path) -> None:
    """OpenTelemetry's API imported (FastAPI does) but no SDK provider: no
    schedule span, no header."""
    url = f"sqlite:///{tmp_path}/api.db"
    reset_tables(url)
    script = "import opentelemetry.trace\n" + NOTHING.replace(
        'loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")\n'
        'assert loaded == [], loaded\n', "")
    done = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]
