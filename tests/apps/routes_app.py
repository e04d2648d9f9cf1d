"""An app with two routed queues, all its settings from the environment
(``DUEBOX_DATABASE_URL``, ``DUEBOX_BROKER_ROUTES``, ...): the relay and the
worker processes of tests/badinput/test_url_passwords.py run
``--app tests.apps.routes_app:app``."""

from typing import Any

import duebox

app = duebox.Duebox.from_env()


@app.task("routes.email", queue="emails")
def email(payload: Any, ctx: duebox.JobContext) -> None:
    return None


@app.task("routes.sms", queue="sms")
def sms(payload: Any, ctx: duebox.JobContext) -> None:
    return None
