"""The ``sqs://`` backend: request shapes and failure handling against moto
(fast, in-process), and the shared contract against LocalStack's SQS.

LocalStack comes from ``localstack/start.sh`` (its own virtual environment,
no Docker): ``DUEBOX_TEST_SQS_ENDPOINT`` names one that is already running;
otherwise the session starts one on a free port of its own and stops it at
the end (the ``sqs_endpoint`` fixture, conftest.py).  The restart
test restarts a LocalStack that script started, or runs
``DUEBOX_TEST_SQS_RESTART``.  Every test works under its own queue-name prefix and
deletes its queues afterwards.  Under ``CI=true`` an unreachable LocalStack
fails the tests instead of skipping them.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import Queues, localstack, sqs_healthy
from conftest import reset_tables, service_missing
from helpers import (
    Running,
    check_no_early_start,
    effect_rows,
    job_row,
    make_app,
    schedule_committed,
)

import duebox
from duebox import MissingDependencyError
from duebox.brokers.base import BrokerContext, Outgoing
from duebox.brokers.sqs import SQSBroker
from duebox.clock import SystemClock
from duebox.errors import BrokerError, ConfigurationError, ValidationError
from duebox.message import JobMessage
from duebox.registry import broker_class

RESTART = os.environ.get("DUEBOX_TEST_SQS_RESTART")


@pytest.fixture
def queues(sqs_endpoint: str) -> Iterator[Queues]:
    q = Queues(sqs_endpoint)
    try:
        yield q
    finally:
        if sqs_healthy(sqs_endpoint):
            q.delete_all()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/duebox.db"
    reset_tables(url)
    return url


def context(name: str = "test") -> BrokerContext:
    return BrokerContext(sa.create_engine("sqlite://"), SystemClock(), duebox.Settings(), name)


def message(queue: str = "default", delay: float = 0.0, version: int = 1,
            **headers: Any) -> JobMessage:
    return JobMessage(uuid.uuid4(), "effect", queue, version, 0,
                      datetime.now(UTC) + timedelta(seconds=delay), {"n": 1}, headers)


# --- configuration (no server) --------------------------------------------------------


def test_url_parameters_and_capabilities() -> None:
    ctx = context()
    cls = broker_class("sqs://")
    assert cls is SQSBroker
    b = cls("sqs://AK:S%2Fk@localhost:4566?prefix=app-&wait=3&visibility_timeout=60&"
            "threads=4&max_message_size=1048576&max_delay=120&check_interval=5", ctx)
    s = b.settings
    assert (s.endpoint, s.region, s.access_key, s.secret_key) == (
        "http://localhost:4566", "us-east-1", "AK", "S/k")
    assert (s.prefix, s.wait, s.visibility_timeout, s.threads) == ("app-", 3, 60, 4)
    assert b.capabilities.payload_limit == 1048576
    assert (b.capabilities.max_delay, b.max_delay, b.capabilities.delay_precision) == (
        900.0, 120.0, 1.0)
    assert not b.capabilities.cancel
    assert b.capabilities.redelivers_unacked
    aws = cls("sqs://?region=eu-west-1", ctx).settings
    assert (aws.endpoint, aws.region, aws.access_key) == (None, "eu-west-1", None)
    assert cls("sqs://sqs.eu-west-1.amazonaws.com?region=eu-west-1", ctx).settings.endpoint \
        == "https://sqs.eu-west-1.amazonaws.com"
    assert cls("sqs://?endpoint=http://ls:4566/", ctx).settings.endpoint == "http://ls:4566"
    assert cls("sqs://h:1?tls=false", ctx).settings.endpoint == "http://h:1"
    fifo = cls("sqs://?region=eu-west-1&fifo=true", ctx)
    assert (fifo.capabilities.max_delay, fifo.max_delay, fifo.capabilities.name) == (
        0.0, 0.0, "sqs-fifo")
    assert fifo.settings.queue_name("jobs") == "duebox-jobs.fifo"
    for bad, field in [("wait=21", "wait"), ("wait=x", "wait"), ("threads=0", "threads"),
                       ("visibility_timeout=0", "visibility_timeout"),
                       ("max_message_size=2000000", "max_message_size"),
                       ("prefix=a.b", "prefix"), ("fifo=maybe", "fifo"),
                       ("max_delay=901", "max_delay"), ("region=EU WEST", "region"),
                       ("endpoint=ftp://x", "endpoint"), ("tls=1", "tls"),
                       ("fifo=1&max_delay=1", "max_delay")]:
        with pytest.raises(ConfigurationError, match=field):
            cls(f"sqs://?{bad}", ctx)
    with pytest.raises(ConfigurationError, match="either"):
        cls("sqs://h:1?endpoint=http://x:2", ctx)
    with pytest.raises(ConfigurationError, match="secret"):
        cls("sqs://onlykey@h:1", ctx)
    with pytest.raises(ValidationError, match="80"):
        b.settings.queue_name("x" * 80)


def test_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("boto3", "botocore", "botocore.config", "botocore.exceptions"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "duebox.brokers.sqs", raising=False)
    with pytest.raises(MissingDependencyError, match=r"duebox\[sqs\]"):
        importlib.import_module("duebox.brokers.sqs")
    monkeypatch.delitem(sys.modules, "duebox.brokers.sqs", raising=False)
    with pytest.raises(MissingDependencyError):
        duebox.Duebox("sqlite://", "sqs://")


# --- request shapes and failures, against moto ------------------------------------------


class Recording:
    """Wraps a boto3 SQS client: records SendMessageBatch calls (time and
    entries) and fails them as told."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[tuple[float, list[dict[str, Any]]]] = []
        self.fail: list[Any] = []  # per call: an exception, a set of Ids to fail, or None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def send_message_batch(self, **kw: Any) -> Any:
        self.calls.append((time.time(), kw["Entries"]))
        plan = self.fail.pop(0) if self.fail else None
        if isinstance(plan, BaseException):
            raise plan
        reply = self.client.send_message_batch(**kw)
        if plan:
            ok = [e for e in reply.get("Successful", []) if e["Id"] not in plan]
            reply["Successful"] = ok
            reply["Failed"] = [{"Id": i, "SenderFault": sender, "Code": "X",
                                "Message": "injected"} for i, sender in plan.items()]
        return reply


@pytest.fixture
def moto_broker() -> Iterator[tuple[SQSBroker, Recording]]:
    moto = pytest.importorskip("moto")
    with moto.mock_aws():
        b = broker_class("sqs://")("sqs://k:s@?region=us-east-1&prefix=m-&wait=0", context())
        asyncio.run(b.open())
        rec = Recording(b._client)
        b._client = rec
        yield b, rec
        asyncio.run(b.close())


def throttled() -> BaseException:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": "RequestThrottled", "Message": "slow down"},
                        "ResponseMetadata": {"HTTPStatusCode": 400}}, "SendMessageBatch")


def test_batches_of_ten_and_only_failed_entries_retried(
        moto_broker: tuple[SQSBroker, Recording]) -> None:
    b, rec = moto_broker
    msgs = [message() for _ in range(23)]
    big = message()
    big = JobMessage(big.job_id, "effect", "default", 1, 0, big.due_at, "x" * 300_000)
    # Call 1: entries 1 and 3 fail on SQS's side, 5 is the sender's fault;
    # call 2 is throttled once.
    rec.fail = [{"1": False, "3": False, "5": True}, throttled()]

    async def go() -> list[Any]:
        return await b.publish([Outgoing(m, 0.0) for m in [*msgs[:12], big, *msgs[12:]]])

    results = asyncio.run(go())
    assert len(results) == 24
    assert [r.ok for r in results].count(False) == 2
    assert not results[5].ok
    assert "injected" in (results[5].error or "")
    assert not results[12].ok
    assert "max_message_size" in (results[12].error or "")
    assert "262144" in (results[12].error or "")
    sizes = sorted(len(entries) for _, entries in rec.calls)
    # 23 sendable: 10 + 10 + 3, one throttled call again, then only the two failed.
    assert sizes == [2, 3, 10, 10, 10], sizes
    retried = [e for _, entries in rec.calls if len(entries) == 2 for e in entries]
    assert {e["Id"] for e in retried} == {"1", "3"}
    assert all(e["Id"] != "12" for _, entries in rec.calls for e in entries)  # never sent


def test_an_outage_is_a_broker_error(moto_broker: tuple[SQSBroker, Recording]) -> None:
    from botocore.exceptions import EndpointConnectionError

    b, rec = moto_broker
    rec.fail = [EndpointConnectionError(endpoint_url="http://x")] * 10
    with pytest.raises(BrokerError, match="SendMessageBatch"):
        asyncio.run(b.publish([Outgoing(message(), 0.0)]))


def test_delays_are_whole_seconds_that_end_at_the_due_time(
        moto_broker: tuple[SQSBroker, Recording]) -> None:
    """DelaySeconds is rounded up from the moment of sending, and the send is
    timed so the whole seconds end just after the due time (``align``)."""
    b, rec = moto_broker
    msgs = [message(delay=d) for d in (0.0, 0.3, 1.55, 2.8, 7.21)]
    asyncio.run(b.publish([Outgoing(m, math.ceil((m.due_at - datetime.now(UTC))
                                                   .total_seconds())) for m in msgs]))
    sent: dict[str, tuple[float, int]] = {}
    for at, entries in rec.calls:
        for e in entries:
            sent[json.loads(e["MessageBody"])["id"]] = (at, e.get("DelaySeconds", 0))
    for m in msgs:
        at, delay = sent[str(m.job_id)]
        visible = at + delay
        due = m.due_at.timestamp()
        assert visible >= due, f"{m.due_at}: visible {due - visible:.3f}s early"
        assert visible - due < 0.2, f"{m.due_at}: {visible - due:.3f}s late"
        assert isinstance(delay, int)
        assert 0 <= delay <= 900


def test_fifo_requests(moto_broker: tuple[SQSBroker, Recording]) -> None:
    moto = pytest.importorskip("moto")
    assert moto
    b = broker_class("sqs://")("sqs://k:s@?region=us-east-1&prefix=m-&fifo=true", context())

    async def go() -> list[Any]:
        await b.open()
        rec = Recording(b._client)
        b._client = rec
        a = message(ordering_key="customer/42")
        c = message(ordering_key="x" * 200)
        d = message()
        res = await b.publish([Outgoing(m, 0.0) for m in (a, c, d)])
        late = await b.publish([Outgoing(message(delay=5), 5.0)])
        await b.close()
        entries = [e for _, es in rec.calls for e in es]
        return [res, late, entries, (a, c, d)]

    res, late, entries, (a, c, d) = asyncio.run(go())
    assert all(r.ok for r in res)
    assert not late[0].ok
    assert "FIFO" in late[0].error
    by_id = {json.loads(e["MessageBody"])["id"]: e for e in entries}
    assert by_id[str(a.job_id)]["MessageGroupId"] == "customer/42"
    assert len(by_id[str(c.job_id)]["MessageGroupId"]) == 64  # hashed: too long
    assert by_id[str(d.job_id)]["MessageGroupId"] == str(d.job_id)
    assert by_id[str(a.job_id)]["MessageDeduplicationId"] == f"{a.job_id}.1"
    assert all("DelaySeconds" not in e for e in entries)
    attrs = by_id[str(a.job_id)]["MessageAttributes"]
    assert attrs["duebox-id"]["StringValue"] == str(a.job_id)
    assert set(attrs) == set(a.header_map())


# --- against LocalStack: the backend itself ----------------------------------------------


async def test_visibility_is_extended_while_a_handler_runs(queues: Queues) -> None:
    """A message held past its visibility timeout is not redelivered: the
    consumer's heartbeat extends it; once acked it is gone."""
    url = queues.url(visibility_timeout=2)
    b = broker_class(url)(url, context("slow"))
    other = broker_class(url)(url, context("other"))
    try:
        [r] = await b.publish([Outgoing(message(), 0.0)])
        assert r.ok
        stream = b.consume(["default"], 4)
        d = await asyncio.wait_for(anext(stream), 10)
        seen = []

        async def watch() -> None:
            async for x in other.consume(["default"], 4):
                seen.append(x)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(4.5)  # more than two visibility timeouts
        assert seen == []
        await b.ack(d)
        await stream.aclose()
        await asyncio.sleep(2.5)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        assert seen == []
        assert queues.held() == 0
    finally:
        await b.close()
        await other.close()


async def test_garbage_goes_to_the_dead_letter_queue(queues: Queues, sqlite_url: str) -> None:
    app = make_app(sqlite_url, queues.url())
    try:
        broker = app.broker()
        url = await broker.queue_url("default")  # type: ignore[attr-defined]
        await broker.close()
        queues.client.send_message(QueueUrl=url, MessageBody="not json")
        async with Running(app, relays=0, workers=1) as r:
            await r.wait(lambda: r.discarded.get("undecodable"), timeout=10,
                         what="the garbage to be rejected")
            await r.wait(lambda: queues.held() == 0, timeout=10, what="it to leave the queue")
        [kept] = queues.drain("dead-letter")
        assert kept["Body"] == "not json"
        assert kept["MessageAttributes"]["duebox-source-queue"]["StringValue"] == "default"
    finally:
        app.dispose()


# --- end to end (the shared clauses run in tests/contract/test_sqs.py) ------------------


async def test_early_message_is_hidden_for_the_rest(sqlite_url: str, queues: Queues) -> None:
    """Clock skew: a message visible 3 s before its due time goes back to SQS
    for the remainder and runs when due, not before."""
    app = make_app(sqlite_url, queues.url())
    job_id = schedule_committed(app, delay=3.0)
    broker = app.broker()
    try:
        row = job_row(app.engine, job_id)
        msg = JobMessage(row.id, row.task, row.queue, row.version, row.attempt,
                         row.due_at.replace(tzinfo=UTC), row.payload)
        assert (await broker.publish([Outgoing(msg, 0.0)]))[0].ok  # visible at once
    finally:
        await broker.close()
    async with Running(app, relays=0, workers=1) as r:
        await r.wait(lambda: effect_rows(app.engine), timeout=15, what="the job to run")
        assert r.worker_total("deferred") >= 1
    check_no_early_start(app.engine)
    app.dispose()


async def test_fifo_keeps_the_order_of_a_group(sqlite_url: str, queues: Queues) -> None:
    """FIFO: published at the due time, in due order; SQS hands out one message
    of a group at a time, so even four concurrent slots run them in order."""
    app = make_app(sqlite_url, queues.url(fifo="true"))
    try:
        base = datetime.now(UTC) + timedelta(seconds=1.0)
        dues = [base + timedelta(milliseconds=40 * i) for i in range(8)]
        ids = [schedule_committed(app, at=due, headers={"ordering_key": "acct-1"})
               for due in reversed(dues)][::-1]
        async with Running(app, workers=1, concurrency=4) as r:
            await r.wait(lambda: len(effect_rows(app.engine)) == len(ids), timeout=20,
                         what="every job to run")
        ran = sorted(effect_rows(app.engine).values(), key=lambda e: e.started_us)
        assert [e.job_id for e in ran] == [str(i) for i in ids]
        check_no_early_start(app.engine)
        assert queues.queue_url("default.fifo") is not None
    finally:
        app.dispose()


@pytest.mark.slow
async def test_far_jobs_stay_parked_until_near_due(sqlite_url: str, queues: Queues) -> None:
    """``?max_delay=5`` and jobs due 20–40 s out: parked in the database, not
    in SQS, published within 5 s of their due time, each run exactly once."""
    app = make_app(sqlite_url, queues.url(max_delay=5))
    try:
        ids = [schedule_committed(app, delay=d) for d in (20, 24, 28, 32, 36, 40)]
        most = 0

        def watch() -> bool:
            nonlocal most
            most = max(most, queues.held())
            return len(effect_rows(app.engine)) == len(ids)

        async with Running(app, workers=1) as r:
            await asyncio.sleep(3)
            assert {job_row(app.engine, j).state for j in ids} == {"SCHEDULED"}
            assert queues.held() == 0
            await r.wait(watch, timeout=60, what="every far job to run")
        check_no_early_start(app.engine)
        assert 1 <= most <= 2  # only jobs within 5 s of their due time were in SQS
        for j in ids:
            row = job_row(app.engine, j)
            ahead = (row.due_at - row.published_at).total_seconds()
            assert 0 <= ahead <= 5.1, f"published {ahead:.2f}s before due"
            assert app.calls.count(j) == 1  # type: ignore[attr-defined]
    finally:
        app.dispose()


def restart_localstack() -> None:
    """DUEBOX_TEST_SQS_RESTART, or ``localstack/start.sh restart`` on a
    LocalStack that script started (it says ``stopped``)."""
    if RESTART:
        proc = subprocess.run(RESTART, shell=True, capture_output=True, timeout=180,
                              check=False)
        restarted = proc.returncode == 0
    else:
        proc = localstack("restart", timeout=180)
        restarted = proc.returncode == 0 and b"stopped" in proc.stdout
    if not restarted:
        service_missing("a LocalStack this test can restart (started by localstack/start.sh, "
                        "or DUEBOX_TEST_SQS_RESTART)",
                        RuntimeError((proc.stdout + proc.stderr).decode()[-2000:]))
