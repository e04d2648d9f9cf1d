"""duebox.observability.causes and .trouble: what a driver's or a broker's exception
says (out of reach, or refusing for good), one line per cause per interval
across every logger, and a refusal taken as final only after its grace.
The commands that end on it, and a real PostgreSQL cut, are
tests/test_trouble_lines.py's."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pymysql
import pytest
from sqlalchemy import exc as sa_exc

from duebox.errors import BrokerRefusedError, BrokerUnreachableError, DatabaseError
from duebox.observability.causes import cause_of
from duebox.observability.logs import CollapsedLog
from duebox.observability.trouble import Troubles, log_trouble

PG_REFUSED = ('connection failed: connection to server at "127.0.0.1", port 5432 failed: '
              'FATAL:  role "nobody" does not exist')
PG_CUT = ('connection failed: connection to server at "10.0.0.5", port 6432 failed: '
          "Connection refused\n\tIs the server running on that host and accepting TCP/IP "
          "connections?")


def wrapped(orig: Exception, invalidated: bool = False) -> Exception:
    """As duebox raises it: SQLAlchemy's error, then db_errors' DatabaseError."""
    try:
        try:
            raise sa_exc.OperationalError("SELECT 1", {}, orig,
                                          connection_invalidated=invalidated)
        except sa_exc.OperationalError as inner:
            raise DatabaseError("claim: database unavailable") from inner
    except DatabaseError as exc:
        return exc


@pytest.mark.parametrize(("exc", "key", "text", "permanent"), [
    (wrapped(psycopg.OperationalError(PG_CUT)), "database unreachable",
     "database unreachable at 10.0.0.5:6432: Connection refused", False),
    (psycopg.OperationalError("consuming input failed: server closed the connection "
                              "unexpectedly\n\tThis probably means ..."),
     "database unreachable", "database unreachable: server closed the connection "
                             "unexpectedly", False),
    (wrapped(psycopg.OperationalError(PG_REFUSED)), "database refused",
     'the database refused the connection: role "nobody" does not exist; check the '
     "database URL's user, password and database name", True),
    (wrapped(pymysql.err.OperationalError(1045, "Access denied for user 'x'@'h'")),
     "database refused", "the database refused the connection: Access denied for user "
                         "'x'@'h'; check the database URL's user, password and database name",
     True),
    (wrapped(pymysql.err.OperationalError(2013, "Lost connection to MySQL server")),
     "database unreachable", "database unreachable: Lost connection to MySQL server", False),
    (BrokerUnreachableError("RabbitMQ at h:5672", "ConnectionRefusedError(111)"),
     "unreachable: RabbitMQ at h:5672", "RabbitMQ at h:5672 unreachable: "
                                        "ConnectionRefusedError(111)", False),
    (BrokerRefusedError("RabbitMQ at h:5672 (vhost '/', user 'u')", "403 ACCESS_REFUSED"),
     "refused: RabbitMQ at h:5672 (vhost '/', user 'u')",
     "RabbitMQ at h:5672 (vhost '/', user 'u') refused the connection: 403 ACCESS_REFUSED",
     True),
], ids=["pg-cut", "pg-listen", "pg-role", "mysql-login", "mysql-lost", "amqp-cut",
        "amqp-login"])
def test_a_cause_is_named_in_one_line_and_a_refusal_is_permanent(
        exc: Exception, key: str, text: str, permanent: bool) -> None:
    cause = cause_of(exc)
    assert cause is not None
    assert (cause.key, cause.text, cause.permanent) == (key, text, permanent)


@pytest.mark.parametrize("exc", [
    psycopg.errors.DeadlockDetected("deadlock detected"),  # the statement's, not the server's
    wrapped(pymysql.err.OperationalError(1213, "Deadlock found")),
    ValueError("no"),
    DatabaseError("claim: no duebox tables"),
], ids=["pg-deadlock", "mysql-deadlock", "other", "no-driver"])
def test_what_is_not_about_reaching_a_server_has_no_cause(exc: Exception) -> None:
    assert cause_of(exc) is None


def test_one_line_per_cause_per_interval_across_loggers(
        caplog: pytest.LogCaptureFixture, seconds: Any) -> None:
    troubles = Troubles(30, clock=seconds)
    cut = cause_of(psycopg.OperationalError(PG_CUT))
    assert cut is not None
    names = ("duebox.db", "duebox.heartbeat", "duebox.liveness", "duebox.worker")
    with caplog.at_level(logging.WARNING, "duebox"):
        for _ in range(10):  # each place meets the cut, again and again
            for name in names:
                troubles.report(cut, logging.getLogger(name), name.split(".")[1])
        seconds.now += 31
        troubles.report(cut, logging.getLogger("duebox.worker"), "delivery")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("duebox.db", "database unreachable at 10.0.0.5:6432: Connection refused (db); "
                      "retrying until it answers"),
        ("duebox.worker", "database unreachable at 10.0.0.5:6432: Connection refused "
                          "(delivery); retrying until it answers [39 more like this in 31s]")]


def test_a_refusal_is_silent_through_its_grace_then_final(
        caplog: pytest.LogCaptureFixture, seconds: Any) -> None:
    troubles = Troubles(30, clock=seconds, grace=5, attempts=3)
    refused = cause_of(BrokerRefusedError("RabbitMQ at h:1", "403 ACCESS_REFUSED"))
    assert refused is not None
    log = logging.getLogger("duebox.broker")
    with caplog.at_level(logging.WARNING, "duebox"):
        for _ in range(10):  # many attempts, but not yet for 5 s: a broker still starting
            troubles.report(refused, log, "opening")
            assert not troubles.final(refused)
        seconds.now += 5
        troubles.report(refused, log, "opening", stops=True)
        assert troubles.final(refused)
    assert caplog.records == []  # the caller that stops says it, once
    assert "refused 11 times over 5 s" in troubles.ended(refused)
    with caplog.at_level(logging.WARNING, "duebox"):
        troubles.report(refused, log, "opening")  # a library's caller keeps going: said
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    # Gone quiet for longer than an interval: the next refusal starts over.
    seconds.now += 60
    troubles.report(refused, log, "opening")
    assert not troubles.final(refused)


def test_loggers_hand_causes_to_the_registry_and_keep_the_rest(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = Troubles()  # the process's registry, as if nothing had happened yet
    monkeypatch.setattr("duebox.observability.trouble.TROUBLES", fresh)
    monkeypatch.setattr("duebox.observability.logs.TROUBLES", fresh)
    log = logging.getLogger("duebox.t_trouble")
    with caplog.at_level(logging.WARNING, "duebox.t_trouble"):
        assert log_trouble(log, "heartbeat", psycopg.OperationalError(PG_CUT),
                           "heartbeat failed: %s", "x")
        assert not log_trouble(log, "heartbeat", ValueError("v"), "heartbeat failed: %s", "v")
        CollapsedLog(log).warning("delivery:X", "delivery failed (%s)",
                                  psycopg.OperationalError(PG_CUT))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1] == "heartbeat failed: v"
    assert "psycopg" not in " ".join(messages)
    assert messages[0].startswith("database unreachable at 10.0.0.5:6432")
    # The CollapsedLog's event joined the heartbeat's cause: no line of its own
    # within the process registry's interval.
    assert len(messages) == 2
