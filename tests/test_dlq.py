"""The dead-letter queue: replay (authorised, audited, rate-limited, checked),
quarantine of poison jobs, purge."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from helpers import Running, attempt_rows, job_row, make_app, schedule_committed

import duebox
from duebox import Permanent, RetryPolicy, ValidationError, dlq
from duebox.cli.main import cli
from duebox.tables import audit, job


def _audit(engine: sa.Engine, job_id: Any = None) -> list[Any]:
    stmt = sa.select(audit).order_by(audit.c.at)
    if job_id is not None:
        stmt = stmt.where(audit.c.job_id == job_id)
    with engine.connect() as conn:
        return list(conn.execute(stmt))


def _app_with_switch(database_url: str) -> tuple[duebox.Duebox, dict[str, Any]]:
    app = make_app(database_url)
    switch: dict[str, Any] = {"fail": True, "error": Permanent}

    @app.task("charge", max_attempts=2, retry=RetryPolicy(base=0.01, cap=0.02),
              validate=lambda p: None if isinstance(p, dict) and "amount" in p else
              (_ for _ in ()).throw(ValueError("amount is required")))
    def charge(payload: Any, ctx: duebox.JobContext) -> None:
        if switch["fail"]:
            raise switch["error"]("provider rejected the request")

    return app, switch


async def _dead(app: duebox.Duebox, *payloads: Any) -> list[Any]:
    ids = [schedule_committed(app, "charge", p) for p in payloads]
    async with Running(app) as r:
        await r.wait(lambda: all(job_row(app.engine, i).state == "DEAD" for i in ids),
                     timeout=15, what="the jobs to be dead")
    return ids


async def test_replay_requires_operator_and_reason_and_changes_nothing(database_url: str) -> None:
    app, _ = _app_with_switch(database_url)
    (job_id,) = await _dead(app, {"amount": 5})
    before = job_row(app.engine, job_id)
    for operator, reason, field in [("", "why", "operator"), ("alice", " ", "reason"),
                                    (None, "why", "operator")]:
        with pytest.raises(ValidationError) as err:
            dlq.replay(app, operator=operator, reason=reason, ids=[job_id])  # type: ignore[arg-type]
        assert err.value.field == field
    assert job_row(app.engine, job_id) == before
    assert _audit(app.engine) == []
    app.dispose()


async def test_replay_keeps_the_job_id_audits_and_runs_again(database_url: str) -> None:
    app, switch = _app_with_switch(database_url)
    (job_id,) = await _dead(app, {"amount": 5})
    dead = job_row(app.engine, job_id)
    switch["fail"] = False
    report = dlq.replay(app, operator="alice", reason="provider fixed", ids=[job_id])
    assert report.replayed == 1
    replayed = job_row(app.engine, job_id)
    assert (replayed.state, replayed.version) == ("SCHEDULED", dead.version + 1)
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "SUCCEEDED", timeout=15,
                     what="the replayed job to succeed")
    attempts = attempt_rows(app.engine, job_id)
    (row,) = _audit(app.engine, job_id)
    app.dispose()
    assert [a.outcome for a in attempts] == ["failed", "succeeded"]
    assert len({a.id for a in attempts}) == 2  # a fresh attempt id, same job id
    assert (row.operator, row.action, row.reason) == ("alice", "replay", "provider fixed")


async def test_a_poison_job_is_quarantined_after_failing_the_same_way(database_url: str) -> None:
    app, _ = _app_with_switch(database_url)
    (job_id,) = await _dead(app, {"amount": 5})
    assert dlq.replay(app, operator="bob", reason="try again", ids=[job_id]).replayed == 1
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "DEAD", timeout=15,
                     what="the replayed job to die again")
    actions = [a.action for a in _audit(app.engine, job_id)]
    assert actions == ["replay", "quarantine"]
    with app.engine.connect() as conn:
        (listed,) = dlq.list_dead(conn)
    assert listed.quarantined
    refused = dlq.replay(app, operator="bob", reason="again", ids=[job_id])
    assert refused.replayed == 0
    assert list(refused.refused) == ["quarantined (replay with force to override)"]
    assert job_row(app.engine, job_id).state == "DEAD"
    forced = dlq.replay(app, operator="bob", reason="fixed the payload", ids=[job_id],
                        force=True)
    app.dispose()
    assert forced.replayed == 1


async def test_a_job_failing_differently_after_replay_is_not_quarantined(
    database_url: str,
) -> None:
    app, switch = _app_with_switch(database_url)
    (job_id,) = await _dead(app, {"amount": 5})
    dlq.replay(app, operator="bob", reason="retry", ids=[job_id])
    switch["error"] = TimeoutError
    async with Running(app) as r:
        await r.wait(lambda: job_row(app.engine, job_id).state == "DEAD", timeout=15,
                     what="the replayed job to die again")
    actions = [a.action for a in _audit(app.engine, job_id)]
    app.dispose()
    assert actions == ["replay"]


async def test_replay_checks_the_payload_still_fits(database_url: str) -> None:
    app, _ = _app_with_switch(database_url)
    good, bad = await _dead(app, {"amount": 5}, {"cents": 500})
    report = dlq.replay(app, operator="carol", reason="bulk", ids=[good, bad])
    assert report.replayed == 1
    assert report.refused == {"payload no longer fits 'charge': ValueError": 1}
    assert job_row(app.engine, bad).state == "DEAD"
    assert [a.job_id for a in _audit(app.engine)] == [good]
    app.dispose()


async def test_replay_spreads_due_times_at_the_rate(database_url: str) -> None:
    app, _ = _app_with_switch(database_url)
    ids = await _dead(app, *[{"amount": i} for i in range(6)])
    report = dlq.replay(app, operator="dave", reason="bulk", error_class="permanent", rate=4.0)
    assert report.replayed == 6
    with app.engine.connect() as conn:
        dues = sorted(conn.execute(sa.select(job.c.due_at).where(job.c.id.in_(ids))).scalars())
    app.dispose()
    gaps = [b - a for a, b in itertools.pairwise(dues)]
    assert all(g >= timedelta(seconds=0.249) for g in gaps), gaps


async def test_purge_deletes_dead_jobs_and_keeps_audit(database_url: str) -> None:
    app, _ = _app_with_switch(database_url)
    ids = await _dead(app, {"amount": 1}, {"amount": 2})
    alive = schedule_committed(app, "charge", {"amount": 3}, delay=3600)
    assert dlq.purge(app, operator="erin", reason="obsolete", ids=[*ids, alive]) == 2
    with app.engine.connect() as conn:
        left = set(conn.execute(sa.select(job.c.id)).scalars())
    rows = _audit(app.engine)
    app.dispose()
    assert left == {alive}
    assert sorted((r.job_id, r.action, r.operator) for r in rows) == sorted(
        (i, "purge", "erin") for i in ids)


async def test_cli_replay_refuses_without_operator_and_shows_progress(
    database_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, _ = _app_with_switch(database_url)
    await _dead(app, {"amount": 1}, {"amount": 2})
    app.dispose()
    monkeypatch.setenv("DUEBOX_DATABASE_URL", database_url)
    monkeypatch.delenv("DUEBOX_OPERATOR", raising=False)
    runner = CliRunner()
    refused = runner.invoke(cli, ["dlq", "replay", "--all", "--reason", "x"])
    assert refused.exit_code == 2
    assert "--operator" in refused.output
    listed = runner.invoke(cli, ["dlq", "list"])
    assert "2 dead job(s)" in listed.output
    done = runner.invoke(cli, ["dlq", "replay", "--all", "--operator", "frank",
                               "--reason", "incident 12", "--rate", "100"])
    assert done.exit_code == 0, done.output
    assert "replayed 0" in done.output  # the CLI's app has no 'charge' task registered
    assert "refused 2: task 'charge' is not registered (give --app)" in done.output
