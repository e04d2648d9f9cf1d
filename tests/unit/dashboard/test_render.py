"""duebox.dashboard.render: every value reaches a page escaped, whatever it
holds; times to the millisecond in UTC; durations in the unit people read."""

from __future__ import annotations

import html
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duebox.dashboard import render
from duebox.dashboard.render import esc

MARKUP = st.text(alphabet=st.sampled_from(list("<>&\"'/=ab \n")), max_size=30) | st.text(
    max_size=30)


@settings(max_examples=200, deadline=None)
@given(MARKUP)
def test_escaped_text_is_the_text_and_no_markup(value: str) -> None:
    shown = esc(value)
    assert html.unescape(shown) == value
    assert not set(shown) & set("<>\"'")


@settings(max_examples=100, deadline=None)
@given(MARKUP, MARKUP, MARKUP)
def test_nothing_a_job_holds_opens_a_tag_on_a_page(state: str, note: str, payload: str) -> None:
    parts = (render.badge(state), render.table(["h"], [[esc(note)]]),
             render.link("/jobs", note, q=payload),
             render.payload_section({"p": payload}, note, False),
             render.compact_json({"p": payload}))
    for part in parts:
        assert "<script" not in part.lower()
        stripped = part
        for tag in ("<span", "</span>", "<table", "</table>", "<thead>", "</thead>", "<tbody>",
                    "</tbody>", "<tr>", "</tr>", "<td>", "</td>", "<th>", "</th>", "<a ",
                    "</a>", "<h2>", "</h2>", "<p ", "</p>", "<pre>", "</pre>", "<td "):
            stripped = stripped.replace(tag, "")
        assert "<" not in stripped, part


def test_a_hidden_payload_is_not_on_the_page() -> None:
    assert "s3cret" not in render.payload_section({"p": "s3cret"}, "hidden: no hook", True)
    assert esc(None) == ""
    assert render.compact_json(None) == ""


def test_times_are_utc_to_the_millisecond() -> None:
    at = datetime(2030, 1, 2, 3, 4, 5, 678_901, tzinfo=UTC)
    assert render.ts(at) == ('<time datetime="2030-01-02T03:04:05.678901+00:00">'
                      "2030-01-02 03:04:05.678Z</time>")
    assert render.ts(None) == "-"


@pytest.mark.parametrize(("value", "shown"), [
    (None, "-"), (0.0004, "0 ms"), (0.25, "250 ms"), (1.0, "1.0 s"), (119.9, "119.9 s"),
    (120.0, "2.0 min"), (7199.0, "120.0 min"), (7200.0, "2.0 h"), (-0.5, "-500 ms"),
    (-90.0, "-90.0 s"),
])
def test_durations_in_the_unit_people_read(value: float | None, shown: str) -> None:
    assert render.seconds(value) == shown


def test_links_drop_empty_parameters_and_escape_the_rest() -> None:
    assert render.link("/jobs", "<x>", state="DEAD", tenant="", q=None) == (
        '<a href="/jobs?state=DEAD">&lt;x&gt;</a>')
    assert render.table(["a", "b"], [], empty="nothing") == (
        '<table class=""><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr>'
        '<td colspan="2" class="empty">nothing</td></tr></tbody></table>')


def test_the_page_marks_the_active_section_and_refreshes_the_live_part() -> None:
    out = render.page("Jobs <1>", "<p>live</p>", "<form></form>", active="/jobs", refresh=2.5)
    assert "<title>Jobs &lt;1&gt; · duebox</title>" in out
    assert '<a href="/jobs" class=active>Jobs</a>' in out
    assert '<div id=live data-refresh="2.5"><p>live</p></div><form></form>' in out
    assert "data-refresh" not in render.page("x", "")
