"""Error text is masked like the payload: an exception message that quotes a
value the task's mask hook hides shows it as ``****`` (job page, attempts,
DLQ list), and where the hook is unknown or fails the text is hidden."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

import duebox
from duebox.masking import REDACTED, hidden_values, masked

from .conftest import Client
from .seed import SECRET, Seeded

Serve = Callable[..., Client]


def test_a_secret_quoted_in_an_error_is_masked_on_every_page(seeded: Seeded,
                                                             serve: Serve) -> None:
    """The job page of a masked task showed ``card 4111-1111-1111-1111
    declined`` in its last error and in its attempts."""
    c = serve(seeded.app)
    for job_id in seeded.dead:
        page = c.get(f"/jobs/{job_id}").text
        assert SECRET not in page
        assert "card **** declined by the provider" in page  # last error
        assert page.count("card **** declined") >= 2  # and the attempt's error
        assert "****1111" in page  # the payload, as the hook masks it
        partial = c.opener.open(urllib.request.Request(
            f"{c.base}/jobs/{job_id}", headers={"X-Duebox-Partial": "1"})).read().decode()
        assert SECRET not in partial
        assert "card **** declined" in partial
    dlq = c.get("/dlq").text
    assert SECRET not in dlq
    assert dlq.count("card **** declined by the provider") == len(seeded.dead)


def test_error_text_is_hidden_where_the_hook_is_unknown(seeded: Seeded, serve: Serve) -> None:
    bare_app = duebox.Duebox(seeded.app.settings.database_url)
    clients: list[Client] = []
    try:
        bare = serve(bare_app)
        clients.append(bare)
        job = bare.get(f"/jobs/{seeded.dead[0]}").text
        assert SECRET not in job
        assert "declined" not in job
        assert "mask hook is unknown" in job
        dlq = bare.get("/dlq").text
        assert SECRET not in dlq
        assert "hidden (the job page says why)" in dlq
        clients.append(shown := serve(bare_app, show_unregistered_payloads=True))
        assert SECRET in shown.get(f"/jobs/{seeded.dead[0]}").text  # asked for
    finally:
        for client in clients:  # before the app's engine goes
            client.server.stop()  # type: ignore[union-attr]
        bare_app.dispose()


def _app(mask: Callable[[Any], Any] | None) -> duebox.Duebox:
    app = duebox.Duebox("sqlite://")

    @app.task("t", mask=mask)
    def t(payload: Any, ctx: duebox.JobContext) -> None:
        pass

    return app


@pytest.mark.parametrize("secret", ["pa'ss\"wörd\\1", "4111 1111", "x" * 5000, "ü\u202e"])
def test_every_quoting_of_a_hidden_value_is_cut(secret: str) -> None:
    payload = {"user": "ann", "auth": {"password": secret, "n": [1, 2.5, 12345678]}}
    m = masked(_app(lambda p: {"user": p["user"]}), "t", payload)
    error = (f"bad login {secret} / {secret!r} / {json.dumps(secret)} / {payload} / "
             f"{json.dumps(payload)} for ann")
    shown = m.text(error)
    assert shown is not None
    assert secret not in shown
    assert repr(secret)[1:-1] not in shown
    assert json.dumps(secret)[1:-1] not in shown
    assert "12345678" not in shown
    assert "for ann" in shown  # what the hook keeps stays
    assert REDACTED in shown


def test_what_the_hook_decides() -> None:
    plain = masked(_app(None), "t", {"card": SECRET})
    assert (plain.payload, plain.text(f"x {SECRET}")) == ({"card": SECRET}, f"x {SECRET}")
    raising = masked(_app(lambda p: p["missing"]), "t", {"card": SECRET})
    assert (raising.hidden, raising.payload, raising.text(SECRET)) == (True, None, None)
    assert "raised KeyError" in raising.note
    unknown = masked(_app(None), "other", {"card": SECRET})
    assert (unknown.hidden, unknown.text(SECRET)) == (True, None)
    # A payload nested past the recursion limit is walked all the same.
    deep: Any = SECRET
    for _ in range(5000):
        deep = [deep]
    assert hidden_values(deep, None) == (SECRET,)
