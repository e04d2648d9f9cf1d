"""consumers/job_lines.py: the line of a finished job, written only when
asked for, with its fields in ``--log-format json``.  The worker writing it
for every job it runs, alone or in a batch: tests/test_job_lines.py."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from duebox.consumers.job_lines import JobLines
from duebox.leases.records import JobRecord
from duebox.observability.logformat import JsonFormatter

DUE = datetime(2030, 1, 1, 9, tzinfo=UTC)


def _record(attempt: int = 2) -> JobRecord:
    return JobRecord(
        id=uuid.UUID(int=42), task="send-reminder", queue="emails", payload={"n": 1},
        headers=None, due_at=DUE, version=1, attempt=attempt, max_attempts=10, priority=0,
        tenant=None, key=None, expires_at=None, lease_owner="w#1", lease_generation=1)


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The ``duebox.jobs`` logger at INFO; ``.records``: what it wrote."""
    caplog.set_level(logging.INFO, logger="duebox.jobs")
    return caplog


def test_a_finished_job_is_one_line_with_its_fields_in_json(
        lines: pytest.LogCaptureFixture) -> None:
    job_lines = JobLines(True)
    job_lines.start()
    started = DUE + timedelta(milliseconds=3)
    job_lines.write(_record(), "succeeded", started, started + timedelta(milliseconds=12))
    [record] = lines.records
    text = record.getMessage()
    assert text == (f"job {uuid.UUID(int=42)} send-reminder attempt 2 succeeded in 0.012s, "
                    "started 0.003s late")
    fields = json.loads(JsonFormatter().format(record))
    assert fields["logger"] == "duebox.jobs"
    assert fields["level"] == "INFO"
    assert {k: fields[k] for k in ("job_id", "task", "queue", "attempt", "outcome",
                                   "run_s", "late_s")} == {
        "job_id": str(uuid.UUID(int=42)), "task": "send-reminder", "queue": "emails",
        "attempt": 2, "outcome": "succeeded", "run_s": 0.012, "late_s": 0.003}


def test_no_line_unless_asked_or_when_the_logger_takes_no_info(
        lines: pytest.LogCaptureFixture) -> None:
    off = JobLines(False)
    off.start()
    off.write(_record(), "succeeded", DUE, DUE)
    logging.getLogger("duebox.jobs").setLevel(logging.WARNING)  # caplog puts it back
    asked = JobLines(True)
    asked.start()  # the logger is looked at once, when the worker starts
    asked.write(_record(), "dead", DUE, DUE)
    assert lines.records == []
    assert not off.enabled
    assert not asked.enabled
