"""Malformed messages, decoded at the boundary and injected straight into each
broker: garbage bodies, missing or forged outbox ids, wrong versions,
oversized payloads, unknown task names.  The worker never crashes, counts each
rejection by reason (``duebox_jobs_discarded_total``), changes no job, and
still runs the next real one."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    Running,
    all_final,
    duebox_row_counts,
    effect_rows,
    job_row,
    make_app,
    memory_url,
    schedule_committed,
)
from hostile import Forger
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox import JobMessage, MessageDecodeError
from duebox.brokers.base import Delivery
from duebox.brokers.memory import MemoryBroker, reset_hubs
from duebox.consumers import Worker
from duebox.metrics import Metrics
from duebox.tables import job

from .common import GOOD, SQLITE_ONLY, body, decode_or_field
from .real_brokers import BACKENDS, real_broker

FIELDS = {"body", "format", "id", "version", "attempt", "task", "queue", "due_at", "headers"}

GARBAGE = [
    (b"\xff\xfe not utf-8", "body"),
    (b"", "body"),
    (b"{not json", "body"),
    (b"[1, 2, 3]", "body"),
    (b'"a string"', "body"),
    (b"null", "body"),
    (body(format="other/2"), "format"),
    (body(format=...), "format"),
    (body(id="not-a-uuid"), "id"),
    (body(id=...), "id"),
    (body(id=12), "id"),
    (body(version=0), "version"),
    (body(version="1"), "version"),
    (body(version=True), "version"),
    (body(version=1.5), "version"),
    # Beyond the job table's 32-bit column: no job has it, and as a query
    # parameter 10**30 failed the batch lane's lock for its whole batch.
    (body(version=2**31), "version"),
    (body(version=10**30), "version"),
    (body(attempt=-1), "attempt"),
    (body(task=""), "task"),
    (body(task=None), "task"),
    # Names @app.task refuses: as query parameters, a NUL failed on PostgreSQL.
    (body(task="t" * 201), "task"),
    (body(task="send\u0000"), "task"),
    (body(task="\ud800"), "task"),
    (body(queue=7), "queue"),
    (body(due_at="tomorrow"), "due_at"),
    (body(due_at="2030-01-01T09:00:00"), "due_at"),  # no offset
    (body(due_at=...), "due_at"),
    (body(due_at=1893488400), "due_at"),
    (body(headers=[1]), "headers"),
]


@pytest.fixture(autouse=True)
def _fresh_hubs() -> Any:
    yield
    reset_hubs()


# --- decoding ---------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "field"), GARBAGE)
def test_a_message_that_is_not_a_duebox_message_names_the_bad_field(
    raw: bytes, field: str
) -> None:
    with pytest.raises(MessageDecodeError) as info:
        JobMessage.decode(raw)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_a_good_message_round_trips() -> None:
    msg = JobMessage.decode(body())
    assert JobMessage.decode(msg.encode()) == msg


def test_an_oversized_garbage_body_is_refused_with_a_short_reason() -> None:
    """The reason is logged and kept beside dead letters: it must not carry
    the megabytes that caused it."""
    with pytest.raises(MessageDecodeError) as info:
        JobMessage.decode(b"{" + b"x" * 3_000_000)
    assert info.value.field == "body"
    assert len(str(info.value)) < 300


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_are_refused_naming_a_field(raw: bytes) -> None:
    msg = decode_or_field(raw)
    if isinstance(msg, str):
        assert msg in FIELDS
    else:
        assert JobMessage.decode(msg.encode()) == msg


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(GOOD)), JSON, max_size=4))
def test_any_spoiled_field_is_refused_by_name_or_round_trips(changes: dict[str, Any]) -> None:
    """Whatever a forger puts in the fields, decode either names the field
    or returns a message that encodes back to itself."""
    msg = decode_or_field(json.dumps({**GOOD, **changes}).encode())
    if isinstance(msg, str):
        assert msg in changes
    else:
        assert msg.version >= 1
        assert msg.attempt >= 0
        assert msg.due_at.tzinfo is not None
        assert JobMessage.decode(msg.encode()) == msg


# --- at a worker: memory:// and sql:// --------------------------------------------------


async def test_garbage_and_forged_messages_are_rejected_without_harm(database_url: str) -> None:
    """A worker fed garbage and forgeries discards each one with its reason,
    keeps running, changes no job, and still runs the real work."""
    # A ceiling of 60 s keeps the parked job in the table, untouched.
    app = make_app(database_url, memory_url() + "?max_delay=60")
    try:
        parked = schedule_committed(app, "effect", delay=3600)
        parked_before = job_row(app.engine, parked)
        now = datetime.now(UTC).isoformat()
        forged = [
            # Right job, wrong version: a replayed or tampered message.
            body(id=str(parked), version=7, due_at=now),
            body(id=str(parked), version=0, due_at=now),  # not even decodable
            # Right job and version but claiming to be due now: must not run early.
            body(id=str(parked), version=1, due_at=now),
            # A job that does not exist.
            body(id=str(uuid.uuid4()), due_at=now),
        ]
        async with Running(app) as r:
            injector = app.broker("injector")
            assert isinstance(injector, MemoryBroker)
            for raw, _ in GARBAGE:
                await injector.inject("default", raw)
            for raw in forged:
                await injector.inject("default", raw)
            real = schedule_committed(app, "effect", {"real": True})
            expected = len(GARBAGE) + len(forged)

            def all_handled() -> bool:
                w = r.workers[0].stats
                return sum(w.discarded.values()) + w.deferred >= expected

            await r.wait(all_handled, timeout=15, what="every bad message to be handled")
            await r.wait(lambda: all_final(app.engine, [real]), timeout=15,
                         what="the real job to run after the garbage")
            stats = r.workers[0].stats
        assert stats.discarded["undecodable"] == len(GARBAGE) + 1
        assert stats.discarded["stale_version"] == 1
        assert stats.discarded["unknown_job"] == 1
        assert stats.deferred == 1  # the early forgery: not due, so not started
        assert stats.succeeded == 1
        assert set(effect_rows(app.engine)) == {str(real)}
        assert job_row(app.engine, parked) == parked_before
        counts = duebox_row_counts(app.engine)
        assert (counts["duebox_job"], counts["duebox_attempt"]) == (2, 1)
    finally:
        await app.adispose()


async def test_a_forged_message_is_refused_on_the_sql_path_too(database_url: str) -> None:
    """``sql://`` workers claim rows, not messages; a delivery handed to one
    directly still goes through the version check."""
    app = make_app(database_url)
    try:
        job_id = schedule_committed(app, "effect")
        before = job_row(app.engine, job_id)
        worker = Worker(app, name="w", metrics=Metrics())
        msg = JobMessage.decode(body(id=str(job_id), version=2,
                                     due_at=datetime.now(UTC).isoformat()))
        await worker.handle(Delivery(message=msg))
        await worker.handle(Delivery(message=None, decode_error="body: garbage"))
        assert dict(worker.stats.discarded) == {"stale_version": 1, "undecodable": 1}
        assert discarded(worker, "stale_version") == 1
        assert job_row(app.engine, job_id) == before
        assert effect_rows(app.engine) == {}
    finally:
        await app.adispose()


@SQLITE_ONLY
async def test_a_row_the_worker_cannot_use_is_dead_lettered_with_the_reason(
    database_url: str,
) -> None:
    """On ``sql://`` the row is the message.  One written by another program
    (or an older deploy) naming a task nobody registered, or holding a
    payload that is not JSON (SQLite does not check), goes to the DLQ with the
    reason; the worker keeps going and runs the real job."""
    app = make_app(database_url)
    try:
        orphan = schedule_committed(app, "effect")
        garbled = schedule_committed(app, "effect")
        with app.engine.begin() as conn:
            conn.execute(sa.update(job).where(job.c.id == orphan).values(task="no-such-task"))
            conn.execute(sa.text("UPDATE duebox_job SET payload = '{not json' WHERE id = :id"),
                         {"id": garbled.hex})
        async with Running(app, relays=0) as r:
            real = schedule_committed(app, "effect")
            await r.wait(lambda: all_final(app.engine, [real]), timeout=15,
                         what="the real job to run")
            await r.wait(lambda: all_final(app.engine, [orphan, garbled], "DEAD"), timeout=15,
                         what="the unusable rows to be dead-lettered")
        rows = {i: job_row(app.engine, i) for i in (orphan, garbled)}
        assert {r.error_class for r in rows.values()} == {"permanent"}
        assert "no-such-task" in rows[orphan].last_error
        assert rows[garbled].last_error.startswith("payload: the stored value is not valid JSON")
        assert set(effect_rows(app.engine)) == {str(real)}
    finally:
        await app.adispose()


def discarded(worker: Worker, reason: str) -> float:
    value = worker.metrics.registry.get_sample_value(
        "duebox_jobs_discarded_total", {"backend": worker.backend, "reason": reason})
    return value or 0.0


# --- injected straight into each real broker ----------------------------------------------

# What each broker carries at most (SQS: 256 KiB), so the oversized forgery
# is as big as that broker lets anyone send — and bigger than schedule() allows.
OVERSIZED = {"redis": 2_000_000, "amqp": 2_000_000, "sqs": 250_000, "kafka": 1_500_000}
# Larger than the backend's own message limit (Kafka's max_message_size,
# 1 MiB): refused unread.
TOO_LARGE = {"kafka"}


@pytest.mark.parametrize("backend", BACKENDS)
@SQLITE_ONLY
async def test_bad_messages_injected_into_the_broker_are_rejected_and_counted(
    backend: str, database_url: str, request: pytest.FixtureRequest
) -> None:
    async with real_broker(backend, request) as broker_url:
        forger = Forger(broker_url)

        async def inject(raw: bytes) -> None:
            await asyncio.to_thread(forger.send, raw)

        app = make_app(database_url, broker_url,
                       max_payload_bytes=min(OVERSIZED[backend] // 2, 200_000))
        metrics = Metrics()
        try:
            async with Running(app, worker_kw={"metrics": metrics}) as r:
                # A first real job proves the consumer is attached before the garbage.
                done = schedule_committed(app, "effect")
                await r.wait(lambda: all_final(app.engine, [done]), timeout=30,
                             what="the first real job to run")
                before = job_row(app.engine, done)
                now = datetime.now(UTC).isoformat()
                garbage = [raw for raw, _ in GARBAGE if raw]
                big = "too_large" if backend in TOO_LARGE else None
                for raw in garbage:
                    await inject(raw)
                await inject(b"{" + b"x" * OVERSIZED[backend])  # oversized garbage
                # An existing job's id with a version it never had.
                await inject(body(id=str(done), version=before.version + 5, due_at=now))
                await inject(body(id=str(uuid.uuid4()), due_at=now))  # no such job
                await inject(body(id=str(uuid.uuid4()), task="no-such-task", due_at=now))
                await inject(body(id=str(uuid.uuid4()), due_at=now,
                                  payload="x" * OVERSIZED[backend]))
                real = schedule_committed(app, "effect", {"real": True})
                expected = Counter({"undecodable": len(garbage), "stale_version": 1,
                                    "unknown_job": 2})
                expected[big or "undecodable"] += 1
                expected[big or "unknown_job"] += 1

                def counted() -> bool:
                    return all(r.discarded.get(k, 0) >= n for k, n in expected.items())

                await r.wait(counted, timeout=60, what=f"the bad messages to be counted "
                             f"(so far {r.discarded})")
                await r.wait(lambda: all_final(app.engine, [real]), timeout=30,
                             what="the real job to run after the garbage")
            assert r.discarded == expected
            worker = r.workers[0]
            for reason, n in expected.items():
                assert discarded(worker, reason) == n, reason
            assert worker.stats.succeeded == 2
            assert job_row(app.engine, done) == before
            assert set(effect_rows(app.engine)) == {str(done), str(real)}
            counts = duebox_row_counts(app.engine)
            assert (counts["duebox_job"], counts["duebox_attempt"]) == (2, 2)
        finally:
            forger.close()
            await app.adispose()


