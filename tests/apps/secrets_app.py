"""Tasks whose failures quote secrets (``--app tests.apps.secrets_app:app``),
for tests/test_secret_keys.py: the app's default secret keys, a task that
opts out (``mask_keys=()``) and one with keys of its own.  The bearer token
the handlers quote comes from ``SECRETS_APP_TOKEN``, as a secret from the
application's own configuration would, never from the payload."""

import os
from typing import Any

import duebox


def build(database_url: str | None = None) -> duebox.Duebox:
    app = duebox.Duebox.from_env()
    app.configure(database_url=database_url)

    def login(payload: dict[str, Any], ctx: duebox.JobContext) -> None:
        creds = {key: payload[key] for key in ("password", "pin", "user") if key in payload}
        token = os.environ.get("SECRETS_APP_TOKEN", "no-token")
        raise duebox.Permanent(f"refused {creds}; the request had "
                               f"{{'Authorization': 'Bearer {token}'}}")

    app.add_task("login", login)
    app.add_task("login-unmasked", login, mask_keys=())
    app.add_task("login-pin", login, mask_keys=["pin"])
    return app


app = build()
