"""How the ``duebox`` command logs: quiet third-party libraries, and text or
one JSON object per line.

A relay or worker talks to its broker through a client library that logs a
lot at INFO (pika wrote over 100 lines per process in a few minutes: every
connection, channel and close).  Those libraries sit at WARNING unless
``--log-level DEBUG`` asks for everything; duebox's own lines say what
matters.  pika sits above ERROR: it logs a failed connection attempt at
ERROR in five or six lines, and every one of its failures reaches duebox as
an exception that duebox's own line names (once per cause per interval,
duebox.observability.trouble).  Your own program configures logging its own way: this is only the
command's (use :class:`JsonFormatter` there too if you like).

``--log-format json`` (``DUEBOX_LOG_FORMAT=json``) writes one JSON object per
line: ``ts``, ``level``, ``logger``, ``message``, and where the line is about
one job ``job_id``, ``task``, ``queue`` and ``attempt`` (the ``extra`` that
:func:`duebox.observability.logs.job_fields` builds), on the line of a finished job
(``log_jobs``) also ``outcome``, ``run_s`` and ``late_s``, and ``traceback``
when there is one.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

# Client libraries whose INFO lines are their own business.  alembic's are
# wanted by `duebox db upgrade` only (it raises alembic back to INFO).
QUIET = ("pika", "aiokafka", "kafka", "botocore", "boto3", "urllib3", "s3transfer",
         "alembic", "asyncio")
# Loggers whose every error reaches duebox as an exception it reports itself.
FOLDED = ("pika",)
# A job's fields; the last three only on the line of a finished job
# (``log_jobs``, consumers/job_lines.py).
FIELDS = ("job_id", "task", "queue", "attempt", "outcome", "run_s", "late_s")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in a message or a
    traceback are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                out[name] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["traceback"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """The command's logging: ``level`` for duebox, WARNING for the client
    libraries in :data:`QUIET` and CRITICAL for those in :data:`FOLDED`
    (unless ``level`` is DEBUG), ``fmt`` text or
    json, on stderr."""
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig: a host's handlers stay its own
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter() if fmt == "json"
                             else logging.Formatter(TEXT_FORMAT))
        root.addHandler(handler)
    root.setLevel(level.upper())
    everything = level.upper() == "DEBUG"
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.DEBUG if everything else logging.WARNING)
    for name in FOLDED:
        logging.getLogger(name).setLevel(logging.DEBUG if everything else logging.CRITICAL)
