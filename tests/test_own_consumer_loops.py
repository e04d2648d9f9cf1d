"""The consumer loops of docs/own-consumers.md, run as the page writes them
(tests/own_loops.py takes each from the page), against the real broker with
a relay running.

Beside real jobs each loop is sent, with that broker's own client, what
anyone who can write to the queue can send (issue #36): a message with no
headers and a body that is none of duebox's; a real job's headers on a body
nested 50,000 deep; a ``duebox-id`` of 300 characters, and one holding a NUL;
a ``duebox-version`` of ``'²'``; a real job's id with another payload and a
version of 0, 2³¹ and 10³⁰; another task; and a genuine copy of a job's
message handed over early.  A loop used to stop for good on the first of
these (and again on its redelivery).  Now each loop logs and acks or
dead-letters what is not a duebox message, holds the early one until due,
and goes on: every real job's e-mail is sent exactly once, never before its
due time on the database's clock.  Where the broker holds a job's message
ahead (RabbitMQ's delay queues, Redis's sorted set, SQS's delay), a job
cancelled and a job rescheduled after the relay marked them ``DELIVERED``
keep their old message from running.

Last, the pika loop as a process whose clock runs 30 s fast (Debian's
``faketime``): the due check is the database server's, so an early copy
waits for the job's due time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from backends import REDIS, KafkaNames, Queues, with_params
from conftest import IN_CI, reset_tables
from helpers import Running, job_row, make_app, schedule_committed, wait_for
from hostile import deep_json
from own_loops import (
    QUEUE,
    StopLoop,
    compiled,
    metadata,
    namespace,
    refusals,
    sent_rows,
    stop_message,
)

import duebox
from duebox.message import JobMessage

ATTACKER = {"to": "attacker"}
FAKETIME = shutil.which("faketime")
PROC = Path(__file__).resolve().parent / "procs" / "own_loop.py"


def _app(database_url: str, broker_url: str) -> duebox.Duebox:
    app = make_app(database_url, broker_url, own_consumer_queues=[QUEUE], lease_seconds=5.0)
    app.add_task("send_email", _not_here, queue=QUEUE)
    metadata.drop_all(app.engine)
    metadata.create_all(app.engine)
    return app


def _not_here(payload: Any, ctx: duebox.JobContext) -> None:  # pragma: no cover
    raise AssertionError("the user's own loop handles these, not duebox's worker")


def _message(app: duebox.Duebox, job_id: uuid.UUID) -> JobMessage:
    """The message the relay publishes for the job, as its row says now."""
    row = job_row(app.engine, job_id)
    return JobMessage(row.id, row.task, row.queue, row.version, row.attempt,
                      row.due_at.astimezone(UTC), row.payload)


def _envelope(msg: JobMessage, **fields: Any) -> bytes:
    """``msg``'s body with ``fields`` replaced, whatever they are."""
    return json.dumps({**json.loads(msg.encode()), **fields}).encode()


@dataclass(frozen=True)
class Forged:
    headers: dict[str, str] | None  # None: no headers at all
    body: bytes | None  # None: (Redis) an entry with no body field
    refused: bool  # not a duebox message: the loop logs a MessageDecodeError


def forgeries(real: JobMessage, early: JobMessage, *, headers: bool = True,
              nul_header: bool = True) -> list[Forged]:
    """What an attacker writes beside the real jobs: ``real``'s id with
    everything else wrong, and ``early``'s genuine message, early.  Without
    ``headers`` (Redis) the header forgeries go into the body instead;
    without ``nul_header`` (SQS refuses NUL in an attribute) that one does."""
    h = real.header_map()
    body = real.encode()
    out = [
        Forged(None, b"{not json", True),
        Forged(None, dataclasses.replace(real, version=0, payload=ATTACKER).encode(), True),
        Forged(None, dataclasses.replace(real, version=2**31, payload=ATTACKER).encode(), True),
        Forged(None, dataclasses.replace(real, version=10**30, payload=ATTACKER).encode(), True),
        Forged(h if headers else None, deep_json(50_000), True),
        # Another task: a copy the job never had, answered DUPLICATE.
        Forged(*_with_headers(dataclasses.replace(real, task="refund", payload=ATTACKER),
                              headers), False),
        # A genuine copy, seconds early: held until due, then run (or DUPLICATE).
        Forged(*_with_headers(early, headers), False),
    ]
    long_id, nul_id = "x" * 300, str(real.job_id)[:-1] + "\x00"
    if headers:
        out += [Forged({**h, "duebox-id": long_id}, body, True),
                Forged({**h, "duebox-version": "²"}, body, True)]
    else:
        out += [Forged(None, _envelope(real, id=long_id, payload=ATTACKER), True),
                Forged(None, _envelope(real, version="²", payload=ATTACKER), True)]
    out.append(Forged({**h, "duebox-id": nul_id}, body, True) if headers and nul_header
               else Forged(None, _envelope(real, id=nul_id, payload=ATTACKER), True))
    return out


def _with_headers(msg: JobMessage, headers: bool) -> tuple[dict[str, str] | None, bytes]:
    return (msg.header_map() if headers else None), msg.encode()


class Loop:
    """One loop of the page, running in a thread (pika, boto3, redis-py)."""

    def __init__(self, heading: str, ns: dict[str, Any],
                 close: Callable[[dict[str, Any]], None]) -> None:
        self.ns = ns
        self.error: BaseException | None = None
        self.stopped = False
        code = compiled(heading)

        def run() -> None:
            try:
                exec(code, ns)
            except StopLoop:
                self.stopped = True
            except BaseException as exc:
                self.error = exc
            finally:
                with contextlib.suppress(Exception):
                    close(ns)

        self.thread = threading.Thread(target=run, daemon=True, name=f"loop-{heading}")
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError("the loop of the page stopped") from self.error
        if not self.thread.is_alive() and not self.stopped:
            raise AssertionError("the loop of the page ended on its own")

    async def stopped_by(self, send_stop: Callable[[], None]) -> None:
        await asyncio.to_thread(send_stop)
        await asyncio.to_thread(self.thread.join, 60)
        self.check()
        assert self.stopped, "the loop did not end on the stop message"

    def end(self, send_stop: Callable[[], None]) -> None:
        """Stop a loop still running: a failed run's loop would go on reading
        and log its refusals into the next test's collector (a rehearsal saw
        13 for 9)."""
        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                send_stop()
            self.thread.join(30)


class Scenario:
    """Real jobs, the forgeries, a cancel and a reschedule after delivery,
    and what must hold at the end.  ``ahead``: the broker holds messages of
    jobs due later, so the relay marks them DELIVERED before their due time."""

    def __init__(self, app: duebox.Duebox, *, ahead: bool) -> None:
        self.app = app
        self.ahead = ahead
        self.now = [schedule_committed(app, "send_email", {"to": f"now-{i}"}) for i in range(3)]
        self.later = schedule_committed(app, "send_email", {"to": "later"}, delay=3.0)
        self.cancelled = self.moved = None
        if ahead:
            self.cancelled = schedule_committed(app, "send_email", {"to": "cancelled"},
                                                delay=4.0)
            self.moved = schedule_committed(app, "send_email", {"to": "moved"}, delay=4.0)
        self.old_due = job_row(app.engine, self.moved or self.later).due_at

    def forgeries(self, **kw: bool) -> list[Forged]:
        return forgeries(_message(self.app, self.now[0]), _message(self.app, self.later), **kw)

    async def run(self, check: Callable[[], None], relay_kw: dict[str, Any] | None = None
                  ) -> None:
        app = self.app
        done = [*self.now, self.later]
        async with Running(app, relays=1, workers=0, relay_kw=relay_kw) as r:
            def checks() -> None:
                r.check()
                check()

            if self.ahead:
                assert self.cancelled is not None
                assert self.moved is not None
                ahead = [self.cancelled, self.moved]
                await wait_for(lambda: all(job_row(app.engine, j).state == "DELIVERED"
                                           for j in ahead), timeout=30, check=checks,
                               what="the jobs due later handed over and DELIVERED")
                version = job_row(app.engine, self.moved).version
                with app.engine.begin() as conn:
                    assert app.cancel(conn, self.cancelled) is True
                    app.reschedule(conn, self.moved, delay=1.0)
                # A new version, for the relay to hand over again (the running
                # relay may claim it at once: DISPATCHING is as right).
                moved = job_row(app.engine, self.moved)
                assert moved.version == version + 1
                assert moved.state in ("SCHEDULED", "DISPATCHING", "DELIVERED")
                done.append(self.moved)
            await wait_for(lambda: all(job_row(app.engine, j).state == "SUCCEEDED"
                                       for j in done), timeout=60, check=checks,
                           what="every real job handled")
            # The old copies of the cancelled and the moved job reach the loop
            # at their old due time: wait past it before the stop message.
            until = self.old_due + timedelta(seconds=1)
            await wait_for(lambda: datetime.now(UTC) > until, timeout=30, check=checks,
                           what="the old due time passed")

    def check_end(self, refused: list[duebox.MessageDecodeError], forged: list[Forged]) -> None:
        app = self.app
        rows = sent_rows(app.engine)
        handled = [*self.now, self.later, *([self.moved] if self.moved else [])]
        expected = sorted(job_row(app.engine, j).payload["to"] for j in handled)
        assert sorted(r.to for r in rows) == expected  # each once; no attacker, no cancelled
        for j in handled:
            row = job_row(app.engine, j)
            assert row.state == "SUCCEEDED"
            (mine,) = [r for r in rows if r.to == row.payload["to"]]
            # Never early, on the clock the due time is kept on.
            assert mine.sent_at_us >= int(row.due_at.timestamp() * 1_000_000), row.payload
        if self.cancelled is not None:
            assert job_row(app.engine, self.cancelled).state == "CANCELLED"
            assert job_row(app.engine, self.moved).version == 2
        assert len(refused) == sum(f.refused for f in forged), [str(e) for e in refused]


@pytest.fixture
def amqp_app(database_url: str, amqp_vhost: str) -> Iterator[tuple[duebox.Duebox, str]]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    app = _app(database_url, with_params(amqp_vhost, prefix=prefix))
    yield app, prefix
    app.dispose()


# --- pika (RabbitMQ) ---------------------------------------------------------------------


def _pika_publish(url: str, queue: str, items: list[tuple[dict[str, str] | None, bytes]]) -> None:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for headers, body in items:
            ch.basic_publish("", queue, body, pika.BasicProperties(headers=headers))
    finally:
        conn.close()


def _queue_depth(url: str, queue: str) -> int:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


async def test_the_pika_loop(amqp_app: tuple[duebox.Duebox, str], amqp_vhost: str) -> None:
    app, prefix = amqp_app
    name = (await app.adeclare_broker([QUEUE]))[QUEUE]
    assert name == f"{prefix}.q.{QUEUE}"
    scenario = Scenario(app, ahead=True)
    forged = scenario.forgeries()
    stop = stop_message()

    def send_stop() -> None:
        _pika_publish(amqp_vhost, name, [(stop.header_map(), stop.encode())])

    loop: Loop | None = None
    try:
        with refusals() as refused:
            loop = Loop("pika (RabbitMQ)", namespace(app, amqp_url=amqp_vhost),
                        lambda ns: ns["connection"].close())
            await asyncio.to_thread(_pika_publish, amqp_vhost, name,
                                    [(f.headers, f.body or b"") for f in forged])
            # near_window: the relay hands jobs due in seconds to RabbitMQ's
            # delay queues at once (DELIVERED ahead) instead of holding them.
            await scenario.run(loop.check, relay_kw={"near_window": 0.5})
            await loop.stopped_by(send_stop)
    finally:
        if loop is not None:
            loop.end(send_stop)
    scenario.check_end(refused, forged)
    # Rejected into the dead-letter queue, as duebox's worker rejects them;
    # only the stop message (never acked) is back in the queue.
    assert _queue_depth(amqp_vhost, f"{prefix}.dead-letter") == len(refused)
    assert _queue_depth(amqp_vhost, name) == 1


# --- boto3 (SQS on LocalStack) --------------------------------------------------------------


async def test_the_boto3_loop(database_url: str, sqs_endpoint: str) -> None:
    queues = Queues(sqs_endpoint)
    app = _app(database_url, queues.url())
    loop: Loop | None = None
    try:
        name = (await app.adeclare_broker([QUEUE]))[QUEUE]
        assert name == queues.prefix + QUEUE
        client = queues.client
        url = client.get_queue_url(QueueName=name)["QueueUrl"]

        def send(items: list[tuple[dict[str, str] | None, bytes]]) -> None:
            for headers, body in items:
                attrs = {k: {"DataType": "String", "StringValue": v}
                         for k, v in (headers or {}).items()}
                client.send_message(QueueUrl=url, MessageBody=body.decode(),
                                    MessageAttributes=attrs)

        stop = stop_message()

        def send_stop() -> None:
            send([(stop.header_map(), stop.encode())])

        scenario = Scenario(app, ahead=True)
        forged = scenario.forgeries(nul_header=False)
        with refusals() as refused:
            loop = Loop("boto3 (SQS)", namespace(app, sqs=client), lambda ns: None)
            await asyncio.to_thread(send, [(f.headers, f.body or b"") for f in forged])
            await scenario.run(loop.check)
            await loop.stopped_by(send_stop)
        scenario.check_end(refused, forged)
    finally:
        if loop is not None:
            loop.end(send_stop)
        app.dispose()
        queues.delete_all()


# --- aiokafka (the Kafka mock cluster) ------------------------------------------------------


async def test_the_aiokafka_loop(database_url: str, kafka_bootstrap: str) -> None:
    from aiokafka import AIOKafkaProducer

    names = KafkaNames(kafka_bootstrap)
    app = _app(database_url, names.url())
    topic = (await app.adeclare_broker([QUEUE]))[QUEUE]
    assert topic == names.prefix + QUEUE

    async def send(items: list[tuple[dict[str, str] | None, bytes]]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            for headers, body in items:
                await producer.send_and_wait(
                    topic, body, headers=[(k, v.encode()) for k, v in (headers or {}).items()]
                    or None)
        finally:
            await producer.stop()

    # Kafka has no delay: the relay publishes a job at its due time, so
    # nothing is DELIVERED ahead to cancel.
    scenario = Scenario(app, ahead=False)
    forged = scenario.forgeries()
    ns = namespace(app, kafka_servers=kafka_bootstrap)
    stopped = asyncio.Event()

    async def loop() -> None:
        try:
            running = eval(compiled("aiokafka"), ns)
            assert inspect.iscoroutine(running)
            await running
        except StopLoop:
            stopped.set()
        finally:
            if "consumer" in ns:
                await ns["consumer"].stop()
            await ns["store"].aclose()

    with refusals() as refused:
        task = asyncio.create_task(loop())

        def check() -> None:
            if task.done():
                task.result()
                raise AssertionError("the loop of the page ended on its own")

        try:
            await send([(f.headers, f.body or b"") for f in forged])
            await scenario.run(check)
            stop = stop_message()
            await send([(stop.header_map(), stop.encode())])
            await asyncio.wait_for(task, 60)
            assert stopped.is_set()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopLoop):
                    await task
            app.dispose()
    scenario.check_end(refused, forged)


# --- redis-py (the stream of redis://) ------------------------------------------------------


async def test_the_redis_py_loop(database_url: str, redis_keys: Any) -> None:
    import redis

    app = _app(database_url, redis_keys.url())
    stream = (await app.adeclare_broker([QUEUE]))[QUEUE]
    assert stream == f"{redis_keys.prefix}:{{{QUEUE}}}:ready"
    client = redis.Redis.from_url(REDIS)

    def send(entries: list[dict[str, Any]]) -> None:
        for fields in entries:
            client.xadd(stream, fields)

    def fields(msg_id: uuid.UUID, f: Forged) -> dict[str, Any]:
        return {"id": str(msg_id), "v": 1, **({} if f.body is None else {"body": f.body})}

    scenario = Scenario(app, ahead=True)
    forged = [*scenario.forgeries(headers=False), Forged(None, None, True)]
    stop = stop_message()

    def send_stop() -> None:
        send([{"id": str(stop.job_id), "v": 1, "body": stop.encode()}])

    loop: Loop | None = None
    try:
        with refusals() as refused:
            loop = Loop("redis-py", namespace(app, r=client), lambda ns: None)
            await asyncio.to_thread(send, [fields(scenario.now[0], f) for f in forged])
            await scenario.run(loop.check)
            await loop.stopped_by(send_stop)
        scenario.check_end(refused, forged)
        # Acked and deleted, all but the stop message; the parked jobs moved.
        assert client.xlen(stream) == 1
        assert redis_keys.pending(QUEUE) == 1
        assert redis_keys.parked(QUEUE) == 0
    finally:
        if loop is not None:
            loop.end(send_stop)
        client.close()
        app.dispose()


# --- a consumer host whose clock runs 30 s fast -----------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
async def test_a_loop_whose_clock_runs_fast_waits_for_the_databases_due_time(
        pg_server_url: str, amqp_vhost: str, tmp_path: Path) -> None:
    """The pika loop of the page as a process under ``faketime -f +30s``,
    handed a genuine copy of a job's message 8 s before its due time.  It
    used to run it at once (its clock said the job was 22 s overdue) and
    mark it SUCCEEDED with a ``finished_at`` after the due time, which hid
    it; the due check is the database server's now, so it waits."""
    if FAKETIME is None:
        if IN_CI:
            pytest.fail("faketime is required under CI=true (apt-get install -y faketime)")
        pytest.skip("faketime is not installed")
    reset_tables(pg_server_url)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    broker_url = with_params(amqp_vhost, prefix=prefix)
    app = _app(pg_server_url, broker_url)
    name = (await app.adeclare_broker([QUEUE]))[QUEUE]
    job_id = schedule_committed(app, "send_email", {"to": "fast"}, delay=8.0)
    copy = _message(app, job_id)
    env = {**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    errors = tmp_path / "consumer.err"
    with errors.open("wb") as err:
        consumer = await asyncio.create_subprocess_exec(
            FAKETIME, "-f", "+30s", sys.executable, str(PROC), pg_server_url, broker_url,
            amqp_vhost, env=env, stdout=asyncio.subprocess.PIPE, stderr=err)

    def check_consumer() -> None:
        assert consumer.returncode is None, errors.read_text()[-3000:]

    try:
        assert consumer.stdout is not None
        line = await asyncio.wait_for(consumer.stdout.readline(), 60)
        skew = float(line.decode().split()[1])
        assert 25 < skew < 35, line  # the process's clock is 30 s ahead
        await asyncio.to_thread(_pika_publish, amqp_vhost, name,
                                [(copy.header_map(), copy.encode())])
        async with Running(app, relays=1, workers=0) as r:
            def check() -> None:
                r.check()
                check_consumer()

            await wait_for(lambda: job_row(app.engine, job_id).state == "SUCCEEDED",
                           timeout=60, what="the job handled by the fast process", check=check)
        stop = stop_message()
        await asyncio.to_thread(_pika_publish, amqp_vhost, name,
                                [(stop.header_map(), stop.encode())])
        await asyncio.wait_for(consumer.wait(), 60)
        assert consumer.returncode == 0, errors.read_text()[-3000:]
    finally:
        if consumer.returncode is None:
            consumer.kill()
            await consumer.wait()
    row = job_row(app.engine, job_id)
    (effect,) = sent_rows(app.engine)
    assert effect.sent_at_us >= int(row.due_at.timestamp() * 1_000_000), "sent early"
    assert row.finished_at >= row.due_at
    app.dispose()
