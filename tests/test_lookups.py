"""Finding a job by id, business key or id prefix: ``app.get_job``, ``duebox
jobs show``/``list`` and the dashboard's search (issue #22 item 5), on every
supported database (the prefix is a primary-key range, whose order differs
per column type)."""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import duebox
from duebox.cli.main import cli
from duebox.reads.pages import parse_filter, search_jobs
from duebox.tables import job

# Two ids that share their first 12 hex digits and a third one just past
# them: an ambiguous prefix, a unique one, and a range edge.
A = uuid.UUID("0190aaaa-bbbb-7000-8000-000000000001")
B = uuid.UUID("0190aaaa-bbbb-7000-8000-000000000002")
C = uuid.UUID("0190aaaa-bbbc-7000-8000-000000000000")


def _app(url: str) -> duebox.Duebox:
    app = duebox.Duebox(database_url=url)
    app.add_task("lookup.noop", lambda p, c: None)
    app.add_task("lookup.other", lambda p, c: None)
    return app


def _jobs(app: duebox.Duebox) -> None:
    """Jobs A, B, C with keys; their ids set to the ones above."""
    with Session(app.engine) as s, s.begin():
        for jid, task, key in ((A, "lookup.noop", "reminder:order-1"),
                               (B, "lookup.noop", "reminder_order-2"),
                               (C, "lookup.other", "%")):
            made = app.schedule(s, task, {"n": 1}, delay=3600, key=key)
            s.execute(update(job).where(job.c.id == made).values(id=jid))


def test_get_job_by_id_key_and_prefix(database_url_all: str) -> None:
    app = _app(database_url_all)
    _jobs(app)
    with Session(app.engine) as s:
        by_id = app.get_job(s, A)
        assert (by_id.id, by_id.state, by_id.attempts, by_id.key) == (
            A, duebox.JobState.SCHEDULED, 0, "reminder:order-1")
        assert by_id.last_error is None
        assert app.get_job(s, "reminder_order-2").id == B
        assert app.get_job(s, str(C)).id == C
        assert app.get_job(s, "0190aaaa-bbbc").id == C  # as the list prints it, cut
        assert app.get_job(s, "0190aaaabbbb70008000000000000001").id == A  # no dashes
        with pytest.raises(duebox.AmbiguousJobError) as amb:
            app.get_job(s, "0190aaaa-bbbb")
        assert amb.value.candidates == [str(A), str(B)]
        assert str(A) in str(amb.value)
        assert "give more of the id" in str(amb.value)
        # A wildcard is text, never a pattern: "%" is C's key, and nothing else.
        assert app.get_job(s, "%").id == C
        for ref in ("0190aaaa%", "0190aaaa-bbb_", "reminder%"):
            with pytest.raises(duebox.JobNotFoundError):
                app.get_job(s, ref)
        for ref, rule in (("x\x00y", "control characters"), ("k" * 100_000, "at most 400"),
                          ("", "must not be empty")):
            with pytest.raises(duebox.ValidationError, match=rule):
                app.get_job(s, ref)
    app.dispose()


async def test_get_job_with_an_async_session(database_url: str) -> None:
    app = _app(database_url)
    _jobs(app)
    async with AsyncSession(app.async_engine) as s:
        info = await app.get_job(s, "reminder:order-1")
    assert (info.id, info.task, info.max_attempts) == (A, "lookup.noop", 10)  # the default
    await app.adispose()


def test_cli_show_and_list_find_jobs_by_key_and_prefix(runner: CliRunner,
                                                       database_url: str) -> None:
    app = _app(database_url)
    _jobs(app)
    app.dispose()
    shown = runner.invoke(cli, ["jobs", "show", "reminder:order-1"])
    assert shown.exit_code == 0, shown.output
    assert f"job {A}" in shown.output
    listed = runner.invoke(cli, ["jobs", "list"])
    line = next(ln for ln in listed.output.splitlines() if "reminder:order-1" in ln)
    cut = line.split()[0][:13]  # what a person copies from the list
    ambiguous = runner.invoke(cli, ["jobs", "show", cut])
    assert ambiguous.exit_code == 1
    assert f"matches several jobs: {A}, {B}" in ambiguous.output
    unique = runner.invoke(cli, ["jobs", "show", str(C)[:-1]])
    assert unique.exit_code == 0
    assert f"job {C}" in unique.output

    as_json = runner.invoke(cli, ["jobs", "list", "--task", "lookup.noop", "--json"])
    assert as_json.exit_code == 0, as_json.output
    rows = [json.loads(ln) for ln in as_json.output.splitlines()]
    assert {(r["id"], r["key"]) for r in rows} == {(str(A), "reminder:order-1"),
                                                   (str(B), "reminder_order-2")}
    # --key is a prefix, and its "_" matches only "_" (not ":" as LIKE would).
    keyed = runner.invoke(cli, ["jobs", "list", "--key", "reminder_", "--json"])
    assert [json.loads(ln)["id"] for ln in keyed.output.splitlines()] == [str(B)]
    keyed = runner.invoke(cli, ["jobs", "list", "--key", "%", "--json"])
    assert [json.loads(ln)["id"] for ln in keyed.output.splitlines()] == [str(C)]


def test_dashboard_search_finds_the_cut_id_it_displays(database_url: str) -> None:
    app = _app(database_url)
    _jobs(app)
    with app.engine.connect() as conn:
        page = search_jobs(conn, parse_filter({"q": str(C)[:13] + "…"}))
        assert [r.id for r in page.rows] == [C]
        page = search_jobs(conn, parse_filter({"q": "0190aaaa-bbbb…"}))
        assert [r.id for r in page.rows] == [A, B]
        page = search_jobs(conn, parse_filter({"q": "0190aaaa%"}))
        assert page.rows == []
    app.dispose()
