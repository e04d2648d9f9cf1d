"""The JSON API over HTTP, on SQLite and PostgreSQL: every page's data as
JSON, masked as the page masks it, and every bad query field a 400 naming
it (docs/dashboard.md, "JSON API")."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

import duebox

from .conftest import Client, Page
from .seed import SECRET, Seeded

Serve = Callable[..., Client]


def _json(page: Page) -> Any:
    return json.loads(page.text)


def _ok(c: Client, path: str) -> Any:
    page = c.get(path)
    assert page.status == 200, (path, page.text[-400:])
    assert SECRET not in page.text, path
    return _json(page)


def test_every_page_has_its_data_as_json(seeded: Seeded, serve: Serve) -> None:
    s = seeded
    c = serve(s.app)
    overview = _ok(c, "/api/overview?ahead=24h")
    assert {"payments", "reports"} <= set(overview["status"]["queues"])
    assert overview["status"]["states"]["DEAD"] == len(s.dead)
    assert overview["coming_up"]["horizon"] == "24h"
    assert sum(b["jobs"] for b in overview["coming_up"]["slices"]) >= len(s.future)
    assert len(overview["lateness"]) == 12
    queues = _ok(c, "/api/queues")
    assert queues["queues"]["payments"]["dlq"] == len(s.dead)
    assert "acme-0" in queues["tenants"]

    dead = _ok(c, "/api/jobs?state=DEAD")
    assert {j["id"] for j in dead["jobs"]} == {str(i) for i in s.dead}
    assert _ok(c, "/api/jobs?q=order-1")["jobs"][0]["id"] == str(s.dead[1])

    job = _ok(c, f"/api/jobs/{s.dead[0]}")
    assert (job["state"], job["error_class"], job["key"]) == ("DEAD", "permanent", "order-0")
    assert job["masking"]["payload"]["card"] == "****1111"
    assert "card **** declined by the provider" in job["last_error"]
    assert all("card **** declined" in a["error"] for a in job["attempts"])
    assert [e["name"] for e in job["timeline"]][:2] == ["created", "due"]
    assert job["where"] == "finished: DEAD"
    assert job["versions"][0]["action"] == "scheduled"

    dlq = _ok(c, "/api/dlq?error_class=permanent")
    assert dlq["total"] == len(s.dead)
    assert all("card **** declined by the provider" in j["error"] for j in dlq["jobs"])

    schedules = _ok(c, "/api/schedules")
    (nightly,) = schedules["schedules"]
    assert (nightly["name"], nightly["timezone"]) == ("nightly-report", "Europe/Berlin")
    assert nightly["next_fire"]["at"]
    one = _ok(c, f"/api/schedules/{s.schedule_id}")
    assert len(one["next_fires"]) == 10
    assert one["masking"]["payload"] == {"kind": "nightly"}

    procs = _ok(c, "/api/processes")
    assert "worker:seed-host:2:ef01" in {p["name"] for p in procs["processes"]}
    assert "shard:0-511" in [lease["name"] for lease in procs["leases"]]


def test_a_schedules_operator_actions_are_served_as_audited_and_escaped(
        seeded: Seeded, serve: Serve) -> None:
    """The pause and resume rows an operator's change wrote (the read side's
    typed ScheduleAction): in the JSON as stored, on the page escaped."""
    s = seeded
    reason = '<script>alert("x")</script> & a reason, Ünïcode, ' + " ".join(["long"] * 100)
    with s.app.engine.begin() as conn:
        assert s.app.schedules.pause(conn, s.schedule_id, operator="ops@example", reason=reason)
    with s.app.engine.begin() as conn:
        s.app.schedules.resume(conn, s.schedule_id, operator="ops@example", reason="back")
    c = serve(s.app)
    actions = _ok(c, f"/api/schedules/{s.schedule_id}")["operator_actions"]
    assert [(a["action"], a["operator"], a["reason"]) for a in actions] == [
        ("schedule_resume", "ops@example", "back"),
        ("schedule_pause", "ops@example", reason)]
    assert all(a["details"]["schedule_id"] == str(s.schedule_id) and a["at"] for a in actions)
    page = c.get(f"/schedules/{s.schedule_id}")
    assert page.status == 200
    assert "<script>alert" not in page.text
    assert "&lt;script&gt;alert" in page.text


def test_pages_of_jobs_follow_the_cursor(seeded: Seeded, serve: Serve) -> None:
    c = serve(seeded.app)
    seen: list[str] = []
    path = "/api/jobs?state=SCHEDULED&limit=7"
    while path:
        page = _ok(c, path)
        assert len(page["jobs"]) <= 7
        seen += [j["id"] for j in page["jobs"]]
        after = urllib.parse.quote(page["next"] or "", safe="")
        path = f"/api/jobs?state=SCHEDULED&limit=7&after={after}" if after else ""
    assert len(seen) == len(set(seen))
    assert {str(i) for i in seeded.future} <= set(seen)


def test_payloads_and_error_text_stay_hidden_where_the_hook_is_unknown(
        seeded: Seeded, serve: Serve) -> None:
    bare_app = duebox.Duebox(seeded.app.settings.database_url)
    try:
        bare = serve(bare_app)
        job = _ok(bare, f"/api/jobs/{seeded.dead[0]}")
        assert job["masking"]["hidden"] is True
        assert job["masking"]["payload"] is None
        assert "mask hook is unknown" in job["masking"]["note"]
        assert job["last_error"] is None
        assert {a["error"] for a in job["attempts"]} == {None}
        assert {j["error"] for j in _ok(bare, "/api/dlq")["jobs"]} == {None}
        leaky = _ok(bare, "/api/jobs?q=leaky-1")["jobs"]
        assert "payload" not in leaky[0], "a search row carries no payload"
    finally:
        bare.server.stop()  # type: ignore[union-attr]  # before the app's engine goes
        bare_app.dispose()


@pytest.mark.parametrize(("path", "status", "field"), [
    ("/api/jobs?state=sleeping", 400, "state"),
    ("/api/jobs?from=yesterday", 400, "from"),
    ("/api/jobs?after=nonsense", 400, "after"),
    ("/api/jobs?limit=0", 400, "limit"),
    ("/api/jobs?limit=201", 400, "limit"),
    ("/api/jobs?limit=%C2%B2", 400, "limit"),  # a digit to str.isdigit, not to int()
    ("/api/jobs?limit=" + "9" * 5000, 400, "limit"),
    ("/api/jobs?stat=DEAD", 400, "stat"),  # a misspelt filter is not "everything"
    ("/api/jobs?q=%00", 400, "q"),
    ("/api/jobs?" + "&".join(f"f{i}=1" for i in range(60)), 400, "query"),
    ("/api/jobs/not-an-id", 400, "job id"),
    (f"/api/jobs/{'0' * 8}-0000-7000-8000-{'0' * 12}", 404, None),
    ("/api/dlq?error_class=oops", 400, "error_class"),
    ("/api/dlq?after=x", 400, "after"),
    ("/api/overview?ahead=7h", 400, "ahead"),
    ("/api/queues?x=1", 400, "x"),
    ("/api/schedules/nope", 400, "schedule"),
    ("/api/nowhere", 404, None),
])
def test_a_bad_request_is_refused_naming_the_field(seeded: Seeded, serve: Serve, path: str,
                                                   status: int, field: str | None) -> None:
    c = serve(seeded.app)
    page = c.get(path)
    assert page.status == status, (path, page.text[-300:])
    error = _json(page)["error"]
    assert (error["status"], error["field"]) == (status, field), error
    assert error["message"]


def test_a_wrong_method_is_405_with_allow(seeded: Seeded, serve: Serve) -> None:
    c = serve(seeded.app)
    for path in ("/api/jobs", f"/api/jobs/{seeded.dead[0]}", "/api/overview"):
        page = c.post(path, {"q": "x"})
        assert page.status == 405, (path, page.text)
        assert _json(page)["error"]["status"] == 405
    with pytest.raises(urllib.error.HTTPError) as refused:  # to read a 405's headers
        c.opener.open(urllib.request.Request(c.base + "/api/jobs", method="DELETE"), timeout=10)
    refused.value.close()
    assert refused.value.code == 405
    assert refused.value.headers["Allow"] == "GET, HEAD"
    assert c.get("/?ahead=7h").status == 400, "the page checks the same field"
