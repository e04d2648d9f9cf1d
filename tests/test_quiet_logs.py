"""Quiet, structured logs (issue #22 item 2): client libraries at WARNING,
first use at INFO in calm words, one line at start and one at stop, and
``--log-format json`` / ``DUEBOX_LOG_FORMAT`` as one JSON object per line."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from conftest import reset_tables

import duebox
from duebox.observability.logformat import QUIET, JsonFormatter, configure
from duebox.observability.logs import job_fields, log_traced


def _lines_until(proc: subprocess.Popen[str], needle: str) -> list[str]:
    """stderr lines up to and including the first that contains ``needle``."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"the process ended before logging {needle!r}: {''.join(seen)}")


def _start_and_stop(args: list[str], cwd: Path, env: dict[str, str], until: str) -> list[str]:
    """``duebox ARGS``'s stderr lines: up to ``until``, then SIGTERM and the rest."""
    with subprocess.Popen([sys.executable, "-m", "duebox", *args], cwd=cwd, env=env,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            lines = _lines_until(proc, until)
            proc.send_signal(signal.SIGTERM)
            assert proc.stderr is not None
            lines += proc.stderr.readlines()
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
    return lines


def test_a_relay_logs_calm_json_lines_one_at_start_and_one_at_stop(
        tmp_path: Path, redis_keys: Any) -> None:
    url = f"sqlite:///{tmp_path}/duebox.db"
    reset_tables(url)
    env = {**os.environ, "DUEBOX_LOG_FORMAT": "json", "DUEBOX_DATABASE_URL": url,
           "DUEBOX_BROKER_URL": redis_keys.url()}
    # The new prefix is checked at once: that line comes right after the start.
    lines = _start_and_stop(["relay"], tmp_path, env, "still there")
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    messages = [r["message"] for r in records]
    assert sum(" started: " in m for m in messages) == 1, messages
    assert sum(m.endswith(" stopped") for m in messages) == 1, messages
    assert [r["level"] for r in records if "still there" in r["message"]] == ["INFO"]
    assert not [r for r in records if r["level"] in ("WARNING", "ERROR")], records
    started = next(r for r in records if " started: " in r["message"])
    assert redis_keys.prefix in started["message"]
    assert started["logger"] == "duebox.relay"


def test_json_lines_carry_the_job_and_its_traceback() -> None:
    job = type("J", (), {"id": uuid.UUID(int=7), "task": "charge", "queue": "payments",
                         "attempt": 2})()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("duebox.test_quiet_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_traced(logger, logging.INFO, "Traceback (most recent call last):\n  boom",
                   "job %s attempt %d failed", job.id, 2, extra=job_fields(job))
    finally:
        logger.removeHandler(handler)
    line = JsonFormatter().format(records[0])
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == f"job {job.id} attempt 2 failed"
    assert (out["job_id"], out["task"], out["queue"], out["attempt"]) == (
        str(job.id), "charge", "payments", 2)
    assert out["traceback"].endswith("  boom")


def test_client_libraries_sit_at_warning_unless_debug_is_asked_for() -> None:
    before = {name: logging.getLogger(name).level for name in (*QUIET, "")}
    try:
        configure("INFO", "text")
        for name in ("aiokafka", "botocore", "alembic"):
            assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
            assert logging.getLogger(f"{name}.sub").isEnabledFor(logging.WARNING), name
        # pika's failures reach duebox as exceptions its own line names (#33 item 7).
        assert not logging.getLogger("pika.connection").isEnabledFor(logging.ERROR)
        assert logging.getLogger("duebox.relay").isEnabledFor(logging.INFO)
        configure("DEBUG", "text")
        assert logging.getLogger("pika").isEnabledFor(logging.DEBUG)
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def test_db_upgrade_shows_alembic_and_status_does_not(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUEBOX_")}
    env["DUEBOX_DATABASE_URL"] = f"sqlite:///{tmp_path}/duebox.db"
    up = subprocess.run([sys.executable, "-m", "duebox", "db", "upgrade"], env=env,
                        capture_output=True, text=True, timeout=60, check=True)
    assert "Running upgrade" in up.stderr  # alembic's INFO lines, wanted here
    status = subprocess.run([sys.executable, "-m", "duebox", "status"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 3  # degraded: no relay or worker, and no work
    assert "alembic" not in status.stderr


def test_a_worker_logs_one_line_at_start_and_one_at_stop(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/duebox.db"
    reset_tables(url)
    env = {**os.environ, "DUEBOX_DATABASE_URL": url, "DUEBOX_BROKER_URL": "sql://",
           "DUEBOX_LOG_FORMAT": "text", "PYTHONPATH": str(Path(__file__).parent.parent)}
    # One process: the worker's own lines (a supervisor adds its own, and
    # each child its pair: tests/test_worker_processes.py counts those).
    lines = _start_and_stop(["worker", "--app", "tests.apps.cli_app:app", "--processes", "1"],
                            tmp_path, env, " started: ")
    assert len(lines) == 2, lines  # nothing else on a calm start and stop
    assert "INFO duebox.worker: worker " in lines[0]
    assert "queues default on sql://" in lines[0]
    assert lines[1].rstrip().endswith(" stopped")


def test_worker_log_jobs_writes_one_json_line_per_finished_job(tmp_path: Path) -> None:
    """``duebox worker --log-jobs`` (issue #33 item 2): the line of each job
    it finished, with its fields; without the switch none (the test above
    counts every line of a calm worker)."""
    url = f"sqlite:///{tmp_path}/duebox.db"
    reset_tables(url)
    producer = duebox.Duebox(url)
    producer.task("cli.noop")(lambda payload, ctx: None)
    job_id = producer.enqueue("cli.noop", {"n": 1})
    producer.dispose()
    env = {**os.environ, "DUEBOX_DATABASE_URL": url, "DUEBOX_BROKER_URL": "sql://",
           "DUEBOX_LOG_FORMAT": "json", "PYTHONPATH": str(Path(__file__).parent.parent)}
    lines = _start_and_stop(["worker", "--app", "tests.apps.cli_app:app", "--processes", "1",
                             "--log-jobs"], tmp_path, env, '"logger": "duebox.jobs"')
    [line] = [r for r in map(json.loads, lines) if r["logger"] == "duebox.jobs"]
    assert (line["job_id"], line["task"], line["queue"], line["attempt"], line["outcome"]) == (
        str(job_id), "cli.noop", "default", 1, "succeeded")
    assert line["level"] == "INFO"
    assert line["run_s"] >= 0
    assert line["late_s"] >= 0
