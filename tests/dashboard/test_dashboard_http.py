"""The dashboard over HTTP (no browser): every page, the refusals, CSRF,
the audit rows actions leave, payload masking, bad input."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from click.testing import CliRunner
from helpers import job_row

import duebox
from duebox.cli.main import cli
from duebox.tables import audit, schedule

from .conftest import TOKEN, Client
from .seed import SECRET, Seeded, seeded_app

Serve = Callable[..., Client]


def _audits(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(audit).order_by(audit.c.at)))


def test_every_page_renders_the_seeded_jobs(sqlite_seeded: Seeded, serve: Serve) -> None:
    s = sqlite_seeded
    c = serve(s.app)
    overview = c.get("/")
    assert overview.status == 200
    assert "payments" in overview.text
    assert "reports" in overview.text
    assert "acme-0" in overview.text
    assert "<svg" in overview.text
    assert "jobs and schedule fire times due in the next 6h" in overview.text
    assert 'data-refresh="2"' in overview.text
    assert "http://" not in overview.text.replace(c.base, ""), "an external URL in the page"
    found = c.get("/jobs?q=order-1")
    assert found.url.endswith(f"/jobs/{s.dead[1]}"), "a key search opens the job"
    job = found.text
    assert "Timeline" in job
    assert "permanent" in job
    assert "declined by the provider" in job
    assert "finished: DEAD" in job
    assert "Audit" in job
    assert c.get("/jobs?state=DEAD").text.count("/jobs/0") >= len(s.dead)
    assert "nightly-report" in c.get("/schedules").text
    assert "Europe/Berlin" in c.get(f"/schedules/{s.schedule_id}").text
    dlq = c.get("/dlq?error_class=permanent")
    assert f"<b>{len(s.dead)}</b> dead job(s)" in dlq.text
    procs = c.get("/processes").text
    assert "worker:seed-host:2:ef01" in procs
    assert "shard:0-511" in procs
    assert c.get("/static/dashboard.js").status == 200


def test_payloads_are_masked_by_the_task_hook_and_hidden_when_it_fails(
        sqlite_seeded: Seeded, serve: Serve) -> None:
    c = serve(sqlite_seeded.app)
    with sqlite_seeded.app.engine.begin() as conn:
        sqlite_seeded.app.schedules.add(conn, "retry-charges", "charge", "0 * * * *",
                                        payload={"amount": 1, "card": SECRET})
    schedule_page = c.get("/schedules/retry-charges").text
    assert SECRET not in schedule_page
    assert "****1111" in schedule_page
    dead = c.get(f"/jobs/{sqlite_seeded.dead[0]}").text
    assert SECRET not in dead
    assert "****1111" in dead
    leaky = c.get("/jobs?q=leaky-1").text
    assert "mask hook raised KeyError" in leaky
    assert '"x"' not in leaky
    # A dashboard whose app does not register the task cannot know its hook.
    bare = serve(duebox.Duebox(sqlite_seeded.app.settings.database_url))
    assert SECRET not in bare.get(f"/jobs/{sqlite_seeded.dead[0]}").text


def test_read_only_dashboard_refuses_every_action(sqlite_seeded: Seeded, serve: Serve) -> None:
    s = sqlite_seeded
    c = serve(s.app)
    assert "name=token" not in c.get(f"/jobs/{s.dead[0]}").text, "no forms when read-only"
    for path in (f"/jobs/{s.dead[0]}/replay", "/dlq/purge", f"/schedules/{s.schedule_id}/pause"):
        r = c.post(path, {"operator": "eve", "reason": "x", "token": ""})
        assert r.status == 403
        assert "read-only" in r.text
    assert job_row(s.app.engine, s.dead[0]).state == "DEAD"
    assert _audits(s.app.engine) == []


def test_actions_need_csrf_token_operator_and_reason(sqlite_seeded: Seeded, serve: Serve) -> None:
    s = sqlite_seeded
    c = serve(s.app, token=TOKEN)
    path = f"/jobs/{s.dead[0]}/replay"
    csrf = c.csrf(f"/jobs/{s.dead[0]}")
    good = {"csrf": csrf, "token": TOKEN, "operator": "alice", "reason": "card fixed"}
    cases = [
        ({**good, "csrf": "0" * 64}, 403, "CSRF"),
        ({**good, "token": "wrong-token"}, 403, "token"),
        ({**good, "token": ""}, 403, "token"),
        ({**good, "operator": " "}, 400, "operator"),
        ({**good, "reason": ""}, 400, "reason"),
    ]
    for form, status, word in cases:
        r = c.post(path, form)
        assert (r.status, word in r.text) == (status, True), (form, r.status, r.text[-300:])
    rebound = c.post(path, good, headers={"Host": "evil.example"})
    assert rebound.status == 421, "a foreign Host on a loopback dashboard is refused"
    assert c.get("/").status == 200
    cross = c.post(path, good, headers={"Origin": "http://evil.example"})
    assert cross.status == 403
    assert "cross-site" in cross.text
    other = Client(c.base)  # another browser: its cookie does not match this field
    other.get("/")
    assert other.post(path, good).status == 403
    assert job_row(s.app.engine, s.dead[0]).state == "DEAD"
    assert _audits(s.app.engine) == []

    done = c.post(path, good)
    assert done.status == 200
    assert "replayed 1" in done.text
    assert job_row(s.app.engine, s.dead[0]).state == "SCHEDULED"
    (row,) = _audits(s.app.engine)
    assert (row.action, row.operator, row.reason, row.job_id) == \
        ("replay", "alice", "card fixed", s.dead[0])
    assert "card fixed" in done.text, "the job page shows the new audit row"


def test_pause_and_resume_a_schedule_write_audit_rows(sqlite_seeded: Seeded,
                                                      serve: Serve) -> None:
    s = sqlite_seeded
    c = serve(s.app, token=TOKEN)
    page = f"/schedules/{s.schedule_id}"
    form = {"token": TOKEN, "operator": "bob", "reason": "maintenance window"}
    r = c.post(f"{page}/pause", {**form, "csrf": c.csrf(page)})
    assert r.status == 200
    assert "paused" in r.text
    assert "Resume" in r.text
    r = c.post(f"{page}/resume", {**form, "csrf": c.csrf(page)})
    assert "resumed; next fire" in r.text
    with s.app.engine.connect() as conn:
        assert conn.execute(sa.select(schedule.c.paused)).scalar_one() is False
    actions = c.get(page).text.split("Operator actions", 1)[1]
    assert actions.count("maintenance window") == 2
    assert [(a.action, a.operator, a.details["schedule"]) for a in _audits(s.app.engine)] == \
        [("schedule_pause", "bob", "nightly-report"), ("schedule_resume", "bob", "nightly-report")]


def test_purge_from_the_dlq_page_and_the_action_limit(sqlite_seeded: Seeded,
                                                      serve: Serve) -> None:
    s = sqlite_seeded
    c = serve(s.app, token=TOKEN)
    form = {"token": TOKEN, "operator": "carol", "reason": "obsolete orders",
            "error_class": "permanent", "csrf": c.csrf("/dlq")}
    r = c.post("/dlq/purge", form)
    assert r.status == 200
    assert f"purged {len(s.dead)}" in r.text
    assert [a.action for a in _audits(s.app.engine)] == ["purge"] * len(s.dead)
    fresh = serve(s.app, token=TOKEN)  # its own limit of 30 actions a minute
    form["csrf"] = fresh.csrf(f"/schedules/{s.schedule_id}")  # the DLQ page has no form now
    statuses = [fresh.post("/dlq/purge", form).status for _ in range(31)]
    assert statuses == [200] * 30 + [429], statuses


def test_bad_input_is_named_and_unknown_pages_are_404(sqlite_seeded: Seeded,
                                                      serve: Serve) -> None:
    c = serve(sqlite_seeded.app)
    for path, status, word in [("/jobs?state=sleeping", 400, "state"),
                               ("/jobs?from=yesterday", 400, "from"),
                               ("/jobs/not-an-id", 400, "job id"),
                               (f"/jobs/{'0' * 8}-0000-7000-8000-{'0' * 12}", 404, "no such job"),
                               ("/dlq?error_class=oops", 400, "error_class"),
                               ("/schedules/nope", 400, "schedule"),
                               ("/nowhere", 404, "no page")]:
        r = c.get(path)
        assert (r.status, word.lower() in r.text.lower()) == (status, True), (path, r.text)


def test_dst_transitions_are_marked_on_the_schedule_page(tmp_path: Any, serve: Serve) -> None:
    from conftest import reset_tables

    url = f"sqlite:///{tmp_path}/dst.db"
    reset_tables(url)
    clock = duebox.FakeClock(datetime(2026, 3, 25, 12, tzinfo=UTC))
    app = seeded_app(url, clock=clock)
    with app.engine.begin() as conn:
        app.schedules.add(conn, "early", "report", "30 2 * * *", timezone="Europe/Berlin")
    text = serve(app).get("/schedules/early").text
    assert "2026-03-29 03:00:00 CEST" in text
    assert "does not exist that day" in text
    assert "Next daylight saving change in Europe/Berlin: <time" in text
    assert "2026-03-29 01:00:00.000Z</time> (CET → CEST)" in text
    assert "2026-03-29 01:00:00.000Z" in text
    assert "class=dst" in text
    app.dispose()


def test_cli_options_come_from_the_environment() -> None:
    result = CliRunner().invoke(cli, ["dashboard", "--help"])
    assert result.exit_code == 0
    for env in ("DUEBOX_DASHBOARD_TOKEN", "DUEBOX_DASHBOARD_PORT", "DUEBOX_DASHBOARD_HOST",
                "DUEBOX_APP"):
        assert env in result.output
    bad = CliRunner().invoke(cli, ["dashboard", "--port", "70000"])
    assert bad.exit_code == 2
    assert "--port" in bad.output


def test_next_transition_finds_the_clock_change_to_the_second() -> None:
    from zoneinfo import ZoneInfo

    from duebox.dashboard.views_ops import next_transition

    berlin = ZoneInfo("Europe/Berlin")
    after = datetime(2026, 11, 29, 12, tzinfo=UTC)
    assert next_transition(berlin, after) == datetime(2027, 3, 28, 1, tzinfo=UTC)
    assert next_transition(ZoneInfo("UTC"), after) is None
    assert next_transition(ZoneInfo("Australia/Sydney"), after) == \
        datetime(2027, 4, 3, 16, tzinfo=UTC)


def test_the_command_serves_the_default_database_until_interrupted(tmp_path: Any) -> None:
    """What a demo user runs: `duebox dashboard` with no --app, in the demo's
    folder; without tables it says how to create them."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    from conftest import reset_tables

    env = {**os.environ, "DUEBOX_DASHBOARD_PORT": "0", "DUEBOX_LOG_LEVEL": "WARNING"}
    env.pop("DUEBOX_DATABASE_URL", None)
    cmd = [sys.executable, "-m", "duebox.cli", "dashboard"]
    empty = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)
    assert empty.returncode == 1
    assert "no database at duebox.db (the file does not exist): run `duebox db upgrade`" \
        in empty.stderr
    assert not (tmp_path / "duebox.db").exists()  # asking created nothing
    reset_tables(f"sqlite:///{tmp_path}/duebox.db")
    # As from a terminal: a test session started in the background by a
    # non-interactive shell ignores SIGINT, and a child would inherit that.
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"on (http://127\.0\.0\.1:\d+) \(read-only\)", line)
        assert m, line
        with urllib.request.urlopen(m.group(1) + "/", timeout=10) as r:
            assert r.status == 200
            assert "no jobs yet" in r.read().decode()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
