"""duebox.routes: the text form of ``broker_routes`` read back whatever the
queue names and URLs, and a route's claim condition on a real SQLite
database: a lane wakes for its own queues' due jobs only.

The forms, the refusals and the grouping are tests/test_routes.py's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import duebox
from duebox.routes import Route, Routes, describe, next_due, parse_routes

URLS = ["redis://h/0", "redis://u:p@h:6379/1?prefix=a", "amqp://guest:guest@h/vh",
        "kafka://k1:9092,k2:9092,k3:9092", "sqs://?region=eu-west-1&fifo=true",
        "sql://?lookahead=1"]
# Queue names the text form can carry: no '=' or ',' (docs: give a JSON object
# then), no surrounding whitespace, and not starting with '{' (the text then
# reads as the JSON form).
QUEUES = st.text(st.characters(exclude_characters="=,", exclude_categories=["Cs", "Zs", "Cc",
                                                                              "Zl", "Zp"]),
                 min_size=1, max_size=10).filter(lambda q: not q.startswith("{"))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(QUEUES, st.sampled_from(URLS), min_size=1, max_size=5),
       st.sampled_from([",", ", ", " ,\t"]))
def test_the_text_form_reads_back_what_was_written(routes: dict[str, str], comma: str) -> None:
    text = comma.join(f"{queue}={url}" for queue, url in routes.items())
    assert parse_routes(text) == routes


def test_routes_to_the_default_url_are_the_default_route() -> None:
    routes = Routes.of("redis://h/0", {"a": "redis://h/0", "b": "amqp://h/"})
    assert routes.routed == {"b": "amqp://h/"}
    assert routes.active
    assert not Routes.of("redis://h/0", {"a": "redis://h/0"}).active
    assert Routes.of("sql://", None).all() == [Route("sql://", default=True)]


def test_a_route_described_for_logs_hides_its_password() -> None:
    routes = Routes.of("amqp://u:pw@h/", {"mail": "redis://:secret@r/0", "sms": "redis://:secret@r/0"})
    assert describe(routes.all()) == ["(default) -> amqp://u:***@h/",
                                      "mail, sms -> redis://:***@r/0"]


@pytest.fixture
def routed_app(sqlite_url: str) -> duebox.Duebox:
    app = duebox.Duebox(sqlite_url, "sql://")
    for queue in ("mail", "sms", "bulk"):
        app.add_task(queue, lambda p, c: None, queue=queue)
    return app


def test_each_route_finds_the_earliest_due_job_of_its_own_queues(routed_app: duebox.Duebox
                                                                 ) -> None:
    t0 = datetime(2031, 1, 1, tzinfo=UTC)
    due = {"mail": t0 + timedelta(seconds=3), "sms": t0 + timedelta(seconds=1),
           "bulk": t0 + timedelta(seconds=2)}
    for queue, at in due.items():
        routed_app.enqueue(queue, at=at)
        routed_app.enqueue(queue, at=at + timedelta(hours=1))
    cancelled = routed_app.enqueue("sms", at=t0)
    with routed_app.engine.begin() as conn:
        assert routed_app.cancel(conn, cancelled)
    default, other = Routes.of("sql://", {"mail": "redis://h/0", "sms": "redis://h/0"}).all()
    with routed_app.engine.connect() as conn:
        assert next_due(conn, other.where()) == due["sms"]  # not the cancelled one
        assert next_due(conn, default.where()) == due["bulk"]
        assert next_due(conn, Route("redis://h/1", queues=("mail",)).where()) == due["mail"]
        assert next_due(conn, None) == due["sms"]
        assert next_due(conn, Route("redis://h/1", queues=("none",)).where()) is None
    routed_app.dispose()
