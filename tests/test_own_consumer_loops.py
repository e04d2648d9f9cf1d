"""Your own consumer loops, one per driver (pika, boto3, aiokafka, redis-py),
each a real loop against the real broker with a relay running, written as
docs/own-consumers.md tells a user to write them.

Each test declares the topology first and starts the loop before the relay's
first publish (the loop looks its queue up and must find it), then checks
that every job ends terminal — ``SUCCEEDED`` through the dedupe decorator's
completion, ``DELIVERED`` for a task the loop only acks — with its effect
once and never before its due time; that forged copies (the same message
again, another version) are answered ``DUPLICATE``; and that nothing is
published again after ``redeliver_after`` has passed several times over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from backends import REDIS, KafkaNames, Queues
from helpers import Running, make_app, schedule_committed, wait_for

import duebox
from duebox import DUPLICATE, SQLDedupeStore
from duebox.message import JobMessage
from duebox.tables import job

REDELIVER_AFTER = 0.5
loop_metadata = sa.MetaData()
sent = sa.Table("own_loop_sent", loop_metadata,
                sa.Column("job_id", sa.String(64), primary_key=True),
                sa.Column("due_at_us", sa.BigInteger, nullable=False),
                sa.Column("sent_at_us", sa.BigInteger, nullable=False))


def _us(t: datetime) -> int:
    return int(t.timestamp() * 1_000_000)


class Mailer:
    """The user's side: what every loop below calls per message, with the
    headers as a mapping and the driver's native message."""

    def __init__(self, app: duebox.Duebox) -> None:
        self.received: list[dict[str, str]] = []
        self.answers: list[Any] = []
        self.errors: list[BaseException] = []
        self.copies: list[tuple[dict[str, str], bytes]] = []  # what a forger would resend

        @duebox.dedupe(SQLDedupeStore(app.engine, consumer="mailer"))
        def send_email(*message: Any, session: Any) -> str:
            headers = self.received[-1]
            session.execute(sent.insert().values(
                job_id=headers["duebox-id"],
                due_at_us=_us(datetime.fromisoformat(headers["duebox-due-at"])),
                sent_at_us=_us(datetime.now(UTC))))
            return "sent"

        self.send_email = send_email

    def on_message(self, headers: Mapping[str, str], body: bytes, *native: Any) -> None:
        """Honour ``duebox-due-at`` (a message may come a little early), then
        handle: ``send_email`` through the dedupe decorator, ``notify``
        acknowledged only (it stays DELIVERED)."""
        headers = dict(headers)
        self.received.append(headers)
        self.copies.append((headers, body))
        early = (datetime.fromisoformat(headers["duebox-due-at"])
                 - datetime.now(UTC)).total_seconds()
        if early > 0:
            time.sleep(early)
        if headers["duebox-task"] == "send_email":
            self.answers.append(self.send_email(*native))
        else:
            self.answers.append("acked")

    def guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self.errors.append(exc)
        return run

    def check(self) -> None:
        if self.errors:
            raise self.errors[0]


def _forged(headers: dict[str, str], body: bytes) -> list[tuple[dict[str, str], bytes]]:
    """The same message again, and one claiming the next version."""
    msg = JobMessage.decode(body)
    newer = dataclasses.replace(msg, version=msg.version + 1)
    return [(headers, body), (newer.header_map(), newer.encode())]


def _app(database_url: str, broker_url: str, queue: str) -> duebox.Duebox:
    app = make_app(database_url, broker_url, own_consumer_queues=[queue],
                   redeliver_after=REDELIVER_AFTER, lease_seconds=5.0)
    for name in ("send_email", "notify"):
        app.add_task(name, _not_here, queue=queue)
    loop_metadata.drop_all(app.engine)
    loop_metadata.create_all(app.engine)
    return app


def _not_here(payload: Any, ctx: duebox.JobContext) -> None:  # pragma: no cover
    raise AssertionError("the user's own loop handles these, not duebox's worker")


def _states(app: duebox.Duebox, ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    with app.engine.connect() as conn:
        return dict(conn.execute(sa.select(job.c.id, job.c.state)  # type: ignore[arg-type]
                                 .where(job.c.id.in_(ids))).all())


async def _scenario(app: duebox.Duebox, mailer: Mailer,
                    forge: Callable[[dict[str, str], bytes], None]) -> None:
    """Schedule, run the relay, forge, and check (the loop already runs)."""
    emails = [schedule_committed(app, "send_email", {"to": f"{i}@example.com"})
              for i in range(2)]
    emails.append(schedule_committed(app, "send_email", {"to": "later"}, delay=1.5))
    notify = schedule_committed(app, "notify", {"text": "hi"})
    ids = [*emails, notify]
    async with Running(app, relays=1, workers=0,
                       relay_kw={"reconcile_interval": 0.2}) as r:
        (relay,) = r.relays

        def check() -> None:
            r.check()
            mailer.check()

        def done() -> bool:
            s = _states(app, ids)
            return (all(s[e] == "SUCCEEDED" for e in emails) and s[notify] == "DELIVERED"
                    and len(mailer.answers) == 4)

        await wait_for(done, timeout=30, what="every job handled", check=check)
        first = next(c for c in mailer.copies if c[0]["duebox-task"] == "send_email")
        for headers, body in _forged(*first):
            await asyncio.to_thread(forge, headers, body)
        await wait_for(lambda: len(mailer.answers) == 6, timeout=30,
                       what="the forged copies answered", check=check)
        # Well past redeliver_after, with recovery and reconciliation passes
        # meanwhile: nothing goes out again.
        until = time.monotonic() + 6 * REDELIVER_AFTER
        passes = relay.totals.passes
        await wait_for(lambda: time.monotonic() > until and relay.totals.passes > passes + 10,
                       timeout=30, what="relay passes after redeliver_after", check=check)
        await asyncio.sleep(0)
        totals = relay.totals
        assert (totals.published, totals.recovered, totals.reconciled) == (4, 0, 0)
    assert mailer.answers[4:] == [DUPLICATE, DUPLICATE]
    assert len(mailer.received) == 6
    assert sorted(mailer.answers[:4], key=str) == ["acked", "sent", "sent", "sent"]
    assert _states(app, ids) == {**dict.fromkeys(emails, "SUCCEEDED"), notify: "DELIVERED"}
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(sent)).all()
    assert sorted(r.job_id for r in rows) == sorted(str(e) for e in emails)
    assert all(r.sent_at_us >= r.due_at_us for r in rows)  # never before due


@contextlib.contextmanager
def _thread(mailer: Mailer, loop: Callable[[threading.Event, threading.Event], None]
            ) -> Iterator[None]:
    """Run a sync driver's loop in a thread; it sets ``ready`` once it found
    its queue (before any publish)."""
    stop, ready = threading.Event(), threading.Event()
    t = threading.Thread(target=mailer.guarded(lambda: loop(stop, ready)), daemon=True)
    t.start()
    try:
        while not ready.wait(0.05):
            mailer.check()
            assert t.is_alive(), "the loop stopped before it was ready"
        yield
    finally:
        stop.set()
        t.join(15)
    mailer.check()


# --- pika (RabbitMQ) ---------------------------------------------------------------------


async def test_a_pika_loop(database_url: str, amqp_vhost: str) -> None:
    import pika

    queue = f"emails{uuid.uuid4().hex[:8]}"
    app = _app(database_url, amqp_vhost, queue)
    name = (await app.adeclare_broker())[queue]
    assert name == f"duebox.q.{queue}" == app.broker_queue_name(queue)
    mailer = Mailer(app)

    def loop(stop: threading.Event, ready: threading.Event) -> None:
        conn = pika.BlockingConnection(pika.URLParameters(amqp_vhost))
        try:
            ch = conn.channel()
            ch.queue_declare(name, passive=True)  # 404 NOT_FOUND had nobody declared it
            ch.basic_qos(prefetch_count=10)
            ready.set()
            for method, props, body in ch.consume(name, inactivity_timeout=0.1):
                if stop.is_set():
                    break
                if method is None:
                    continue
                mailer.on_message(props.headers or {}, body, props, body)
                ch.basic_ack(method.delivery_tag)
        finally:
            conn.close()

    def forge(headers: dict[str, str], body: bytes) -> None:
        conn = pika.BlockingConnection(pika.URLParameters(amqp_vhost))
        conn.channel().basic_publish("", name, body, pika.BasicProperties(headers=headers))
        conn.close()

    with _thread(mailer, loop):
        await _scenario(app, mailer, forge)
    app.dispose()


# --- boto3 (SQS on LocalStack) --------------------------------------------------------------


async def test_a_boto3_loop(database_url: str, sqs_endpoint: str) -> None:
    queues = Queues(sqs_endpoint)
    queue = "emails"
    app = _app(database_url, queues.url(), queue)
    try:
        name = (await app.adeclare_broker([queue]))[queue]
        assert name == queues.prefix + queue
        mailer = Mailer(app)
        client = queues.client

        def loop(stop: threading.Event, ready: threading.Event) -> None:
            url = client.get_queue_url(QueueName=name)["QueueUrl"]  # exists: declared
            ready.set()
            while not stop.is_set():
                reply = client.receive_message(QueueUrl=url, MaxNumberOfMessages=10,
                                               WaitTimeSeconds=1,
                                               MessageAttributeNames=["All"])
                for m in reply.get("Messages", []):
                    headers = {k: v["StringValue"]
                               for k, v in m.get("MessageAttributes", {}).items()}
                    mailer.on_message(headers, m["Body"].encode(), m)
                    client.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])

        def forge(headers: dict[str, str], body: bytes) -> None:
            url = client.get_queue_url(QueueName=name)["QueueUrl"]
            client.send_message(QueueUrl=url, MessageBody=body.decode(), MessageAttributes={
                k: {"DataType": "String", "StringValue": v} for k, v in headers.items()})

        with _thread(mailer, loop):
            await _scenario(app, mailer, forge)
    finally:
        app.dispose()
        queues.delete_all()


# --- aiokafka (the Kafka mock cluster) ------------------------------------------------------


async def test_an_aiokafka_loop(database_url: str, kafka_bootstrap: str) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    names = KafkaNames(kafka_bootstrap)
    queue = "emails"
    app = _app(database_url, names.url(), queue)
    topic = (await app.adeclare_broker([queue]))[queue]
    assert topic == names.prefix + queue
    mailer = Mailer(app)
    stop, ready = asyncio.Event(), asyncio.Event()

    async def loop() -> None:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka_bootstrap,
                                    group_id=f"mailer-{uuid.uuid4().hex[:8]}",
                                    auto_offset_reset="earliest", enable_auto_commit=False,
                                    fetch_max_wait_ms=10)
        await consumer.start()
        try:
            ready.set()
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=100)
                for records in batches.values():
                    for rec in records:
                        headers = {k: v.decode() for k, v in rec.headers}
                        await asyncio.to_thread(mailer.on_message, headers, rec.value, rec)
                if batches:
                    await consumer.commit()
        finally:
            await consumer.stop()

    async def aforge(headers: dict[str, str], body: bytes) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(topic, body, headers=[(k, v.encode())
                                                               for k, v in headers.items()])
        finally:
            await producer.stop()

    main = asyncio.get_running_loop()

    def forge(headers: dict[str, str], body: bytes) -> None:
        asyncio.run_coroutine_threadsafe(aforge(headers, body), main).result(30)

    task = asyncio.create_task(loop())
    try:
        await asyncio.wait_for(ready.wait(), 30)
        await _scenario(app, mailer, forge)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        app.dispose()


# --- redis-py (the stream of redis://) ------------------------------------------------------


async def test_a_redis_py_loop(database_url: str, redis_keys: Any) -> None:
    import redis

    queue = "emails"
    url = redis_keys.url()
    app = _app(database_url, url, queue)
    stream = (await app.adeclare_broker([queue]))[queue]
    assert stream == f"{redis_keys.prefix}:{{{queue}}}:ready"
    held = stream.removesuffix(":ready") + ":held"
    group = "duebox"  # the broker URL's ``group``, created by declare
    mailer = Mailer(app)
    client = redis.Redis.from_url(REDIS)

    def loop(stop: threading.Event, ready: threading.Event) -> None:
        client.xinfo_groups(stream)  # the stream and its group exist: declared
        ready.set()
        while not stop.is_set():
            reply = client.xreadgroup(group, "mailer-1", {stream: ">"}, count=10, block=100)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    msg = JobMessage.decode(fields[b"body"])
                    mailer.on_message(msg.header_map(), fields[b"body"], (entry_id, fields))
                    # The ack duebox's worker makes: the entry, and the
                    # relay's note of where the job's message is.
                    with client.pipeline(transaction=True) as p:
                        p.xack(stream, group, entry_id).xdel(stream, entry_id)
                        p.hdel(held, fields[b"id"]).execute()

    def forge(headers: dict[str, str], body: bytes) -> None:
        msg = JobMessage.decode(body)
        client.xadd(stream, {"id": str(msg.job_id), "v": msg.version, "body": body})

    try:
        with _thread(mailer, loop):
            await _scenario(app, mailer, forge)
        assert client.hlen(held) == 0
        assert redis_keys.parked(queue) == 0  # the relay moved the later one on time
    finally:
        client.close()
        app.dispose()
