"""duebox.observability.logs.CollapsedLog: one line per kind of event per interval, with a
count, and a traceback only the first time."""

from __future__ import annotations

import logging

import pytest

from duebox.observability.logs import CollapsedLog, CollapsingFilter, kind_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_repeats_within_the_interval_are_counted_not_written(
        caplog: pytest.LogCaptureFixture, clock: Clock) -> None:
    log = CollapsedLog(logging.getLogger("t.collapse"), interval=30, clock=clock)
    with caplog.at_level(logging.WARNING, "t.collapse"):
        for i in range(12_000):  # a 6 s outage's worth of failed deliveries
            clock.now += 0.0005
            log.warning("db", "delivery failed (%s)", i)
        clock.now += 30
        log.warning("db", "delivery failed (%s)", "again")
    assert lines(caplog) == ["delivery failed (0)",
                             "delivery failed (again) [11999 more like this in 36s]"]


def test_kinds_are_collapsed_separately(caplog: pytest.LogCaptureFixture, clock: Clock) -> None:
    log = CollapsedLog(logging.getLogger("t.kinds"), interval=30, clock=clock)
    with caplog.at_level(logging.WARNING, "t.kinds"):
        for _ in range(3):
            log.warning("a", "A")
            log.warning("b", "B")
    assert lines(caplog) == ["A", "B"]


def test_flush_reports_the_repeats_left_uncounted(caplog: pytest.LogCaptureFixture,
                                                  clock: Clock) -> None:
    log = CollapsedLog(logging.getLogger("t.flush"), interval=30, clock=clock)
    with caplog.at_level(logging.WARNING, "t.flush"):
        log.flush()  # nothing pending: nothing written
        for n in range(5):
            clock.now += 1
            log.warning("pass", "relay pass failed (%s)", n)
            log.flush()  # within the interval: the repeats wait
        clock.now += 30
        log.flush()
        log.flush()
    assert lines(caplog) == ["relay pass failed (0)",
                             "relay pass failed (4) [4 like this in 34s]"]


def test_a_traceback_is_written_the_first_time_only(caplog: pytest.LogCaptureFixture,
                                                    clock: Clock) -> None:
    log = CollapsedLog(logging.getLogger("t.trace"), interval=1, clock=clock)
    try:
        raise AttributeError("'NoneType' object has no attribute 'nodeId'")
    except AttributeError as exc:
        error = exc
    with caplog.at_level(logging.WARNING, "t.trace"):
        for _ in range(3):
            clock.now += 2
            log.warning(kind_of(error), "relay pass failed", exc_info=error)
    assert [r.exc_info is not None and r.exc_info[0] is not None
            for r in caplog.records] == [True, False, False]


def test_the_kind_of_a_wrapped_driver_error_names_both() -> None:
    from duebox.errors import BrokerError

    wrapped = BrokerError("down")
    wrapped.__cause__ = ConnectionResetError()
    assert kind_of(wrapped) == "BrokerError<ConnectionResetError>"
    assert kind_of(ValueError()) == "ValueError"


def test_a_librarys_repeated_records_pass_once_per_interval_with_a_count(
        caplog: pytest.LogCaptureFixture, clock: Clock) -> None:
    """As pika's: one logger, the same template, different arguments."""
    logger = logging.getLogger("t.library.connection")
    collapsing = CollapsingFilter(interval=30, clock=clock)
    logger.addFilter(collapsing)
    try:
        with caplog.at_level(logging.ERROR, "t.library.connection"):
            for attempt in range(15):
                clock.now += 0.5
                try:
                    raise ConnectionRefusedError(attempt)
                except ConnectionRefusedError:
                    logger.exception("connection_lost: %r", attempt)
                logger.error("Probably incompatible Protocol Versions")
            clock.now += 30
            logger.error("connection_lost: %r", "again")
    finally:
        logger.removeFilter(collapsing)
    assert lines(caplog) == ["connection_lost: 0", "Probably incompatible Protocol Versions",
                             "connection_lost: 'again' [14 more like this in 37s]"]
    assert caplog.records[0].exc_info is not None


def test_pika_logs_are_collapsed_on_every_pika_logger() -> None:
    from duebox.brokers.amqp_link import PIKA_LOGS

    for name in ("pika.adapters.base_connection", "pika.connection",
                 "pika.adapters.utils.connection_workflow"):
        assert PIKA_LOGS in logging.getLogger(name).filters
