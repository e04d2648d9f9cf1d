"""core/reads/results.py: what a result may be (JSON a payload may be, a bare
number too, at most ``max_result_bytes``), refused naming ``result``; the
task options that ask for one.  Results kept, read, refused at run time and
pruned by the relay, end to end: tests/test_results.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

import duebox
from duebox.reads.results import check_result


@pytest.mark.parametrize("value", [None, 1.0, 2**70, "text", [1, "a"], {"a": {"b": [None]}}])
def test_json_results_are_kept_as_their_exact_text(value: Any) -> None:
    text = check_result(value, 1000)
    assert json.loads(text) == value
    assert type(json.loads(text)) is type(value)


@pytest.mark.parametrize(("value", "rule"), [
    ({1, 2}, "result: must be JSON-serialisable"),
    (float("nan"), "result: must be JSON-serialisable"),
    ({"a": (1, 2)}, "result: result['a']: must be JSON"),
    ({1: "a"}, "result: dict keys must be strings"),
])
def test_what_is_not_json_is_refused_naming_the_result(value: Any, rule: str) -> None:
    with pytest.raises(duebox.ValidationError) as caught:
        check_result(value, 1000)
    assert caught.value.field == "result"
    assert str(caught.value).startswith(rule)


def test_the_size_limit_is_exact() -> None:
    check_result("x" * 8, 10)  # '"xxxxxxxx"': 10 bytes
    with pytest.raises(duebox.ValidationError, match=r"^result: must encode to at most 10 bytes "
                                                     r"of JSON \(max_result_bytes\) \(got '11 "):
        check_result("x" * 9, 10)


def test_task_options_for_results_are_checked() -> None:
    app = duebox.Duebox("sqlite://", "memory://results")
    with pytest.raises(duebox.ConfigurationError, match=r"^store_result: must be True or False"):
        app.task("a", store_result="yes")  # type: ignore[arg-type]
    with pytest.raises(duebox.ConfigurationError, match=r"^result_ttl: keeps a result only"):
        app.task("b", result_ttl=60)
    with pytest.raises(duebox.ConfigurationError, match=r"^result_ttl: must be a number"):
        app.task("c", store_result=True, result_ttl=0)
    with pytest.raises(duebox.ConfigurationError, match=r"^max_result_bytes: "):
        duebox.Settings(max_result_bytes=0)
    app.task("d", store_result=True, result_ttl=60)(lambda payload, ctx: None)
    assert app.tasks["d"].group_commit is False  # a result is kept with a job run alone
    assert app.tasks["d"].result_ttl == 60
    assert duebox.Settings.from_env({"DUEBOX_RESULT_TTL": "3600"}).result_ttl == 3600
