"""Queue names a broker cannot use.

Refused with a ValidationError naming ``queue`` when a task is registered,
when the broker is changed under registered tasks, when a recurring schedule
names one and when a job is scheduled — each broker by its own rules
(``Broker.check_queue_name``): RabbitMQ's topic wildcards and 255-byte names,
SQS's and Kafka's character sets and lengths with the prefix, Redis's hash
tags; control, format and surrogate characters everywhere.  A job that got
into the table with such a name anyway (a row written by hand, an older
producer) is refused by the relay with the broker's reason in
``last_error`` and ends DEAD after its task's attempts: never the endless
claim and release of issue #17 (40 claims in 8 s, no reason, never dead).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import Running, attempt_rows, job_row, make_app, schedule_committed
from hypothesis import given, settings
from hypothesis import strategies as st

import duebox
from duebox import ConfigurationError, ValidationError
from duebox.consumers import Worker
from duebox.tables import job
from duebox.tasks import RetryPolicy, Task

from .common import nothing_written
from .real_brokers import BACKENDS, real_broker

URLS = {
    "amqp": "amqp://guest:guest@127.0.0.1:5672/?prefix=duebox",
    "sqs": "sqs://test:test@127.0.0.1:4566?prefix=app-",
    "kafka": "kafka://127.0.0.1:19092?prefix=" + "p" * 99 + ".",
    "redis": "redis://127.0.0.1:6379/0?prefix=duebox",
    "sql": "sql://",
    "memory": "memory://queue-names",
}
# Refused by every backend: text no broker name should hold (control, format,
# surrogate and line separator characters).  Longer than the job table's 200
# characters is refused at registration by the task options already.
UNPRINTABLE = st.characters(categories=["Cc", "Cf", "Cs", "Zl", "Zp"])
EVERYWHERE = st.tuples(st.text(max_size=10), UNPRINTABLE, st.text(max_size=10)).map("".join)
WORD = st.text(alphabet="abcxyz019-_", min_size=1, max_size=8)
BAD = {
    "amqp": (st.tuples(st.lists(WORD, max_size=3), st.sampled_from(["*", "#"]),
                       st.lists(WORD, max_size=3)).map(lambda t: ".".join([*t[0], t[1], *t[2]]))
             # 2 bytes each: past 255 bytes with the prefix and the tier key.
             | st.text(alphabet="éß", min_size=120, max_size=200)),
    "sqs": (st.tuples(WORD, st.characters(exclude_characters="-_", exclude_categories=[
                "Lu", "Ll", "Nd"]), WORD).map("".join)
            | st.text(alphabet="abc", min_size=77, max_size=200)),
    "kafka": (st.tuples(WORD, st.characters(exclude_characters="._-", exclude_categories=[
                  "Lu", "Ll", "Nd"]), WORD).map("".join)
              | st.text(alphabet="abc", min_size=150, max_size=200)),
    "redis": st.tuples(WORD, st.sampled_from(["{", "}"]), WORD).map("".join),
}
GOOD = {
    "amqp": st.lists(WORD, min_size=1, max_size=5).map(".".join),
    "sqs": st.text(alphabet="AZaz09_-", min_size=1, max_size=76),
    "kafka": st.text(alphabet="AZaz09_.-", min_size=1, max_size=149),
    "redis": st.text(alphabet=st.characters(exclude_characters="{}", include_characters=" ",
                                            categories=["L", "N", "P", "S"]),
                     min_size=1, max_size=200),
    "sql": st.text(alphabet=st.characters(include_characters=" ",
                                          categories=["L", "N", "P", "S"]),
                   min_size=1, max_size=200),
}
GOOD["memory"] = GOOD["sql"]


def registered(url: str, queue: str) -> duebox.Duebox:
    app = duebox.Duebox("sqlite://", url)
    app.add_task("t", lambda payload, ctx: None, queue=queue)
    return app


@pytest.mark.parametrize("backend", sorted(URLS))
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_a_queue_name_the_broker_cannot_use_is_refused_when_the_task_is_registered(
        backend: str, data: st.DataObject) -> None:
    bad = data.draw(BAD.get(backend, st.nothing()) | EVERYWHERE, label="queue")
    app = duebox.Duebox("sqlite://", URLS[backend])
    with pytest.raises(ValidationError) as info:
        app.add_task("t", lambda payload, ctx: None, queue=bad)
    assert info.value.field == "queue"
    assert app.tasks == {}


@pytest.mark.parametrize("backend", sorted(URLS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_queue_name_the_broker_can_use_is_accepted(backend: str,
                                                     data: st.DataObject) -> None:
    good = data.draw(GOOD[backend], label="queue")
    app = registered(URLS[backend], good)
    assert app.new_job("t").queue == good


def test_changing_the_broker_under_a_task_it_cannot_serve_is_refused() -> None:
    app = registered("sql://", "a.*.b")  # any printable name will do on sql://
    with pytest.raises(ValidationError) as info:
        app.configure(broker_url=URLS["amqp"])
    assert info.value.field == "queue"
    assert "wildcards" in info.value.rule
    assert app.settings.broker_url == "sql://"


def test_a_recurring_schedule_naming_an_unusable_queue_is_refused() -> None:
    app = registered(URLS["sqs"], "jobs")
    with pytest.raises(ValidationError) as info:
        app.schedules.validate("nightly", "t", "0 3 * * *", queue="jobs.nightly")
    assert info.value.field == "queue"
    assert app.schedules.validate("nightly", "t", "0 3 * * *", queue="jobs-nightly")


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_scheduling_onto_an_unusable_queue_writes_nothing(database_url: str) -> None:
    """A task that bypassed registration (set into ``app.tasks`` by hand) is
    still refused at schedule(), before any SQL: the caller's transaction
    goes on and commits its own row."""
    app = make_app(database_url, URLS["amqp"])
    app.tasks["bypass"] = Task(name="bypass", fn=lambda p, c: None, queue="orders.#")
    try:
        with app.engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS business (n int)"))
            conn.execute(sa.text("INSERT INTO business VALUES (1)"))
            with pytest.raises(ValidationError) as info:
                app.schedule(conn, "bypass", {})
            assert info.value.field == "queue"
            conn.execute(sa.text("INSERT INTO business VALUES (2)"))
        with app.engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM business")).scalar_one() == 2
            conn.execute(sa.text("DROP TABLE business"))
            conn.commit()
        nothing_written(app.engine)
    finally:
        app.dispose()


def test_a_worker_told_to_consume_an_unusable_queue_stops_with_a_configuration_error(
) -> None:
    app = registered(URLS["kafka"], "jobs")
    worker = Worker(app, queues=["jobs", "jobs/2"])
    with pytest.raises(ConfigurationError, match="queues: queue"):
        asyncio.run(worker.run())


# The unusable name each backend is given by a row written by hand.
UNUSABLE = {"amqp": "a.*.b", "sqs": "a.b", "kafka": "a b", "redis": "a{b}"}
ATTEMPTS = 3


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_job_the_broker_refuses_for_good_ends_dead_with_the_brokers_reason(
        backend: str, database_url: str, request: pytest.FixtureRequest) -> None:
    async with real_broker(backend, request) as broker_url:
        app = make_app(database_url, broker_url)
        app.add_task("refused", lambda payload, ctx: None, max_attempts=ATTEMPTS,
                     retry=RetryPolicy(base=0.1, cap=0.2))
        try:
            stuck = schedule_committed(app, "refused")
            with app.engine.begin() as conn:
                conn.execute(sa.update(job).where(job.c.id == stuck)
                             .values(queue=UNUSABLE[backend]))
            async with Running(app, workers=1) as r:
                fine = schedule_committed(app, "effect")
                await r.wait(lambda: str(job_row(app.engine, stuck).state) == "DEAD",
                             timeout=60, what="the refused job to be dead-lettered")
                await r.wait(lambda: str(job_row(app.engine, fine).state) == "SUCCEEDED",
                             timeout=60, what="the other job to run")
                claims = r.relays[0].totals.claimed
            row: Any = job_row(app.engine, stuck)
            assert row.error_class == "refused"
            assert row.last_error.startswith("queue: ")
            assert repr(UNUSABLE[backend]) in row.last_error
            attempts = attempt_rows(app.engine, stuck)
            assert [a.outcome for a in attempts] == ["refused"] * ATTEMPTS
            assert all(a.error == row.last_error for a in attempts)
            assert row.attempt == ATTEMPTS
            assert claims == ATTEMPTS + 1  # its attempts and the other job: no loop
        finally:
            await app.adispose()
