"""The shop's jobs.  The relay and the worker run as Django management commands
(``manage.py duebox relay`` / ``manage.py duebox worker``), on the database in
Django's settings."""

from typing import Any

from django.conf import settings
from duebox_django import database_url
from sqlalchemy import text

import duebox

jobs = duebox.Duebox(database_url=database_url(), broker_url=settings.DUEBOX_BROKER_URL)


@jobs.task("send-confirmation", max_attempts=5)
def send_confirmation(payload: dict[str, Any], ctx: duebox.JobContext) -> None:
    # ctx.session is the job's own transaction (SQLAlchemy, on the same
    # database): this update commits with the job's completion, so it happens
    # once per job.  Writes through Django's ORM here would commit on their
    # own, outside it.
    ctx.session.execute(text("UPDATE orders_order SET confirmations = confirmations + 1 "
                             "WHERE id = :id"), {"id": payload["order_id"]})
