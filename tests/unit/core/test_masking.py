"""duebox.masking: what people may see of one job, decided from its task
and payload, failing closed: a hook that raises or a task this app does not
know hides payload and error text both.

Through the dashboard, the CLI and the logs this is tests/test_secret_keys.py's
and tests/dashboard's; here :func:`masked_for` and :class:`Masked` alone."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import duebox
from duebox.masking import HIDDEN_TEXT, REDACTED, hidden_values, masked, masked_for, masked_text
from duebox.secret_keys import DEFAULT_MASK_KEYS, SecretKeys
from duebox.tasks import Task

KEYS = SecretKeys.of(DEFAULT_MASK_KEYS)


NO_KEYS = SecretKeys()


def task(mask: Any = None, keys: SecretKeys = NO_KEYS) -> Task:
    return Task(name="t", fn=lambda p, c: None, queue="default", mask=mask, secret_keys=keys)


def test_a_task_with_neither_hook_nor_keys_shows_everything_as_it_is() -> None:
    payload = {"password": "hunter2", "n": 1}
    seen = masked_for(task(), payload)
    assert (seen.payload, seen.note, seen.hidden) == (payload, "", False)
    assert seen.text("failed for {'password': 'hunter2'}") == "failed for {'password': 'hunter2'}"


def test_secret_keys_mask_the_payload_and_their_values_in_error_text() -> None:
    payload = {"user": "bob", "auth": {"api_key": "k-123"}, "items": [{"token": 99}]}
    seen = masked_for(task(keys=KEYS), payload)
    assert seen.payload == {"user": "bob", "auth": {"api_key": REDACTED},
                            "items": [{"token": REDACTED}]}
    assert seen.note == "values of secret keys masked (mask_keys)"
    # A hidden value is cut out wherever the text quotes it, however quoted.
    assert seen.text("KeyError: 'k-123' (code 99)") == f"KeyError: '{REDACTED}' (code {REDACTED})"
    assert seen.text("bob failed") == "bob failed"


def test_the_hook_runs_first_and_what_it_dropped_is_cut_from_text() -> None:
    def hook(payload: dict[str, Any]) -> dict[str, Any]:
        return {"card": "****" + payload["card"][-4:], "password": payload["password"]}

    payload = {"card": "4111111111111111", "password": "pw-1", "cvv": "737"}
    seen = masked_for(task(mask=hook, keys=KEYS), payload)
    assert seen.payload == {"card": "****1111", "password": REDACTED}
    assert seen.note == "masked by the task's mask hook"
    text = seen.text('declined: {"card": "4111111111111111", "cvv": "737", "pw": "pw-1"}')
    assert text is not None
    for secret in ("4111111111111111", "737", "pw-1"):
        assert secret not in text


def test_a_hook_that_raises_hides_payload_and_error_text() -> None:
    def hook(payload: Any) -> Any:
        raise KeyError("card")

    seen = masked_for(task(mask=hook), {"card": "4111"})
    assert (seen.payload, seen.hidden) == (None, True)
    assert seen.note == "hidden: the task's mask hook raised KeyError"
    assert seen.text("anything at all") is None
    assert masked_text(task(mask=hook), {"card": "4111"}, "boom 4111") == f"({HIDDEN_TEXT})"


def test_an_unregistered_task_is_hidden_unless_asked_then_the_apps_keys_apply() -> None:
    payload = {"password": "pw", "n": 1}
    hidden = masked_for(None, payload, keys=KEYS)
    assert (hidden.payload, hidden.hidden) == (None, True)
    assert hidden.text("error pw") is None
    shown = masked_for(None, payload, show_unregistered=True, keys=KEYS)
    assert shown.payload == {"password": REDACTED, "n": 1}
    assert shown.note == "task not registered here: shown without a mask hook"
    assert shown.text("error pw") == f"error {REDACTED}"


def test_the_apps_registration_decides(app: duebox.Duebox) -> None:
    app.add_task("login", lambda p, c: None)
    assert masked(app, "login", {"token": "t"}).payload == {"token": REDACTED}
    assert masked(app, "gone", {"token": "t"}).hidden
    app.configure(mask_keys="none")
    assert masked(app, "login", {"token": "t"}).payload == {"token": "t"}


@settings(max_examples=150, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["password", "apiKey", "user", "n", "X-Auth-Token"]), inner, max_size=3),
    max_leaves=10))
def test_no_value_under_a_secret_key_survives_in_the_payload_or_quoted_text(
        payload: Any) -> None:
    seen = masked_for(task(keys=KEYS), payload)
    secrets = set(hidden_values(payload, seen.payload))

    def leaves(value: Any, under_secret: bool = False) -> list[tuple[Any, bool]]:
        if isinstance(value, dict):
            return [x for k, v in value.items() for x in leaves(v, under_secret or KEYS.hides(k))]
        if isinstance(value, list):
            return [x for v in value for x in leaves(v, under_secret)]
        return [(value, under_secret)]

    kept = {str(v) for v, secret in leaves(payload) if not secret}
    for value, secret in leaves(payload):
        if secret and value is not None and str(value) and str(value) not in kept \
                and not isinstance(value, bool):
            assert str(value) in secrets
            text = seen.text(f"failed on {value!r}")
            assert text is not None
            assert repr(value) not in text


def test_hidden_values_lists_longest_first_in_every_quoting() -> None:
    secret = 'it\'s "x"'
    cut = hidden_values({"a": secret, "b": "x"}, {"a": REDACTED, "b": "x"})
    assert cut == ('it\'s \\"x\\"', 'it\\\'s "x"', secret)  # JSON's, repr's, as is


def test_a_task_copy_with_other_keys_masks_by_its_own() -> None:
    own = replace(task(), secret_keys=SecretKeys.of(("pin",)))
    assert masked_for(own, {"pin": 1234, "password": "p"}).payload == {
        "pin": REDACTED, "password": "p"}


@pytest.mark.parametrize("payload", [None, 5, "plain", [1, 2]])
def test_payloads_without_keys_pass_through(payload: Any) -> None:
    assert masked_for(task(keys=KEYS), payload).payload == payload


def test_a_result_is_masked_like_the_payload() -> None:
    """A job's result (duebox.reads.results) as people see it: secret keys'
    values masked, what the payload's hook hid cut out of its strings, and
    nothing of it where the payload is hidden; the value itself untouched."""
    payload = {"card": "4111-1111-1111-1111", "user": "bob"}
    result = {"charged": True, "note": "card 4111-1111-1111-1111 ok",
              "auth": [{"token": "t-9"}], "user": "bob"}
    hook = masked_for(task(mask=lambda p: {**p, "card": "****1111"}, keys=KEYS), payload)
    assert hook.value(result) == {"charged": True, "note": f"card {REDACTED} ok",
                                  "auth": [{"token": REDACTED}], "user": "bob"}
    assert result["note"] == "card 4111-1111-1111-1111 ok"  # a copy was masked
    assert masked_for(task(keys=KEYS), payload).value("t-9") == "t-9"  # a bare value
    assert masked_for(task(), payload).value(result) == result
    assert masked_for(None, payload).value(result) is None  # hidden: unknown task
