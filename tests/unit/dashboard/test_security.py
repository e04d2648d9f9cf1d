"""duebox.dashboard.security: who may change things.  A mutating request
needs this dashboard's token, a CSRF field signed for this browser's cookie
and not expired, an operator and a reason; a cross-site request is refused
before its body is read; failures are throttled.  The clock is the test's.

Over HTTP (cookies, 429s, the audit rows) this is tests/dashboard's."""

from __future__ import annotations

import pytest

from duebox import ValidationError
from duebox.dashboard.security import CSRF_COOKIE, CSRF_MAX_AGE, Guard
from duebox.dashboard.web import HTTPError, Request

from ..conftest import Seconds

TOKEN = "operator-token-1"
COOKIE = "ab" * 32


@pytest.fixture
def guard(seconds: Seconds) -> Guard:
    return Guard(TOKEN, secret=b"k" * 32, clock=seconds, proxied=["dash.example"])


def post(guard: Guard, *, cookie: str = COOKIE, csrf: str | None = None, token: str = TOKEN,
         operator: str = "ana", reason: str = "cleanup", client: str = "10.0.0.1",
         **headers: str) -> Request:
    form = {"csrf": guard.csrf_field(cookie) if csrf is None else csrf, "token": token,
            "operator": operator, "reason": reason}
    return Request("POST", "/dlq/purge", form=form, cookies={CSRF_COOKIE: cookie},
                   headers={"host": "127.0.0.1:8377", **headers}, client=client)


def refusal(guard: Guard, request: Request) -> tuple[int, str]:
    with pytest.raises(HTTPError) as refused:
        guard.authorize(request)
    return refused.value.status, refused.value.message


def test_a_complete_request_names_its_operator_and_reason(guard: Guard) -> None:
    assert guard.authorize(post(guard, operator=" ana ", reason="old jobs")) == ("ana",
                                                                                 "old jobs")


def test_a_read_only_dashboard_refuses_every_action(seconds: Seconds) -> None:
    guard = Guard(None, clock=seconds)
    assert guard.read_only
    assert refusal(guard, post(guard))[0] == 403
    with pytest.raises(ValidationError):
        Guard("short", clock=seconds)


@pytest.mark.parametrize("change", [
    {"token": "wrong-token-0"}, {"token": ""}, {"csrf": ""}, {"csrf": "123.abc"},
    {"cookie": "cd" * 32},  # a field signed for another browser's cookie
])
def test_a_wrong_token_or_csrf_field_is_refused(guard: Guard, change: dict[str, str]) -> None:
    request = post(guard, **change)
    if "cookie" in change:  # the field was signed for COOKIE
        request.form["csrf"] = guard.csrf_field(COOKIE)
    status, message = refusal(guard, request)
    assert status == 403
    assert message.startswith("refused: ")


def test_a_csrf_field_expires_and_one_from_the_future_is_a_clock_step(guard: Guard,
                                                                     seconds: Seconds) -> None:
    field = guard.csrf_field(COOKIE)
    seconds.now += CSRF_MAX_AGE
    guard.authorize(post(guard, csrf=field))
    seconds.now += 1
    assert "the form has expired" in refusal(guard, post(guard, csrf=field))[1]
    seconds.now -= CSRF_MAX_AGE + 1 + 59  # issued 59 s "in the future": the clock stepped back
    guard.authorize(post(guard, csrf=field))
    seconds.now -= 2
    assert "the form has expired" in refusal(guard, post(guard, csrf=field))[1]


@pytest.mark.parametrize(("headers", "allowed"), [
    ({"origin": "http://127.0.0.1:8377"}, True),
    ({"origin": "http://evil.example"}, False),
    ({"origin": "null"}, False),
    ({"origin": "http://127.0.0.1:9999"}, False),
    ({"origin": "https://127.0.0.1:8377"}, False),  # https only behind a proxy's name
    ({"origin": "http://127.0.0.1:8377/path"}, False),
    ({"sec-fetch-site": "same-origin"}, True),
    ({"sec-fetch-site": "none"}, True),
    ({"sec-fetch-site": "cross-site"}, False),
    ({"sec-fetch-site": "same-site"}, False),
])
def test_only_this_dashboards_pages_may_act(guard: Guard, headers: dict[str, str],
                                            allowed: bool) -> None:
    request = post(guard, **headers)
    if allowed:
        guard.before_body(request)
    else:
        with pytest.raises(HTTPError) as refused:
            guard.before_body(request)
        assert refused.value.status == 403


def test_https_is_this_dashboards_origin_under_a_proxied_name(guard: Guard) -> None:
    request = post(guard, origin="https://dash.example")
    request.headers = {**request.headers, "host": "dash.example"}
    guard.before_body(request)


def test_failed_attempts_are_throttled_before_the_token_is_compared(guard: Guard) -> None:
    for _ in range(10):
        assert refusal(guard, post(guard, token="wrong-token-0"))[0] == 403
    status, message = refusal(guard, post(guard))  # the right token, too late
    assert status == 429
    assert "too many failed attempts" in message
    assert guard.authorize(post(guard, client="10.0.0.2")) == ("ana", "cleanup")


def test_operator_and_reason_are_required_and_printable(guard: Guard) -> None:
    assert refusal(guard, post(guard, operator=""))[0] == 400
    status, message = refusal(guard, post(guard, reason="ok\nforged: line"))
    assert status == 400
    assert "reason" in message


def test_a_cookie_is_issued_once_and_kept(guard: Guard) -> None:
    value, set_cookie = guard.cookie(Request("GET", "/"))
    assert len(value) == 64
    assert set_cookie is not None
    assert set_cookie.startswith(f"{CSRF_COOKIE}={value}; ")
    assert "HttpOnly" in set_cookie
    assert "SameSite=Strict" in set_cookie
    assert guard.cookie(Request("GET", "/", cookies={CSRF_COOKIE: value})) == (value, None)
    forged, again = guard.cookie(Request("GET", "/", cookies={CSRF_COOKIE: "x" * 64}))
    assert again is not None
    assert forged != "x" * 64
