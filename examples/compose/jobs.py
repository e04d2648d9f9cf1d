"""The app compose.yaml's relay, worker and dashboard run until you give
them yours (``DUEBOX_APP_DIR=../shop DUEBOX_APP=shop.jobs:app``).

Its settings come from the ``DUEBOX_*`` environment compose.yaml sets
(database, broker), so the same module serves any of the backends there.
Schedule a job from the host, against the published PostgreSQL port::

    DUEBOX_DATABASE_URL=postgresql+psycopg://duebox:duebox@127.0.0.1:5432/duebox \\
        python -c "from jobs import app; app.enqueue('send-reminder', {'order_id': 42})"

and watch it run: ``docker compose logs worker``, or the dashboard at
http://127.0.0.1:8377.
"""

from __future__ import annotations

import logging

import duebox

log = logging.getLogger("jobs")

app = duebox.Duebox.from_env()


@app.task("send-reminder")
def send_reminder(payload: dict[str, int], ctx: duebox.JobContext) -> None:
    log.info("reminder for order %s (attempt %s)", payload["order_id"], ctx.attempt)
