"""Job results: what a handler returned, kept for a while when its task asks
(``@app.task(store_result=True)``).

* **What is kept.**  The return value's JSON text, in ``duebox_result``
  (one row per job, written in the handler's transaction with its
  completion: a result exists exactly when the job SUCCEEDED).  It must be
  JSON as a payload must (duebox.validation: no tuples, no non-``str`` keys, no
  NaN...; a bare number is fine, the text is kept as text) and encode to at
  most ``max_result_bytes`` (64 KiB by default).  A result that is not, is
  the attempt's failure: a :class:`ValidationError` naming ``result`` and
  the rule, classed *permanent* (the handler would return the same again),
  so the job goes to the dead-letter queue with its writes rolled back, to
  be replayed once the handler is fixed.
* **For how long.**  ``result_ttl`` seconds after the job finished (the
  task's own, else the setting's: a day), then the relay deletes it, in
  bounded batches, once a minute (:class:`Pruning`).  Until then
  ``app.get_job()`` returns it as ``JobInfo.result``.
* **Who sees what.**  ``JobInfo.result`` is the value as returned (the
  app's own code reading its own data, as ``last_error`` is).  Wherever
  people read it (``duebox jobs show``, the dashboard) the values of secret
  keys are masked as a payload's are (duebox.masking: the app's
  ``mask_keys``, or the task's own).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, Insert, Select, delete, insert, select

from ..db import db_errors
from ..errors import ValidationError
from ..tables import result
from ..validation import check_json, encode_json

# How often a relay deletes expired results, and how many per statement.
PRUNE_EVERY = 60.0
PRUNE_BATCH = 1_000


@dataclass(frozen=True)
class Kept:
    """A result checked and ready to store with the job's completion."""

    text: str  # its JSON
    ttl: float  # seconds it is kept after the job finished


def check_result(value: Any, limit: int) -> str:
    """The JSON text of a handler's return value, or a :class:`ValidationError`
    naming ``result`` and the rule it breaks."""
    text = encode_json(value, "result")
    size = len(text)  # the encoder writes ASCII: characters are bytes
    if size > limit:
        raise ValidationError("result", f"must encode to at most {limit} bytes of JSON "
                                        "(max_result_bytes)", f"{size} bytes")
    if isinstance(value, dict | list):  # a bare value is kept as text, exactly
        check_json(value, "result")
    return text


def store(job_id: uuid.UUID, kept: Kept, now: datetime) -> tuple[Insert, dict[str, Any]]:
    """The statement that keeps a result, with its parameters: in the
    transaction of the job's completion."""
    return _STORE, {"job_id": job_id, "value": kept.text, "stored_at": now,
                    "expires_at": now + timedelta(seconds=kept.ttl)}


_STORE = insert(result)


def read_stmt(job_id: uuid.UUID) -> Select[Any]:
    """The job's result's JSON text, if one is kept (:func:`loaded` reads it)."""
    return select(result.c.value).where(result.c.job_id == job_id)


def loaded(text: str | None) -> Any:
    """A kept result's value (None for none)."""
    return None if text is None else json.loads(text)


def prune(conn: Connection, now: datetime, limit: int = PRUNE_BATCH) -> int:
    """Delete up to ``limit`` results kept past their time; how many."""
    ids: Sequence[uuid.UUID] = conn.execute(
        select(result.c.job_id).where(result.c.expires_at <= now)
        .order_by(result.c.expires_at).limit(limit)).scalars().all()
    if not ids:
        return 0
    return conn.execute(delete(result).where(result.c.job_id.in_(ids))).rowcount


class Pruning:
    """A relay's step: every :data:`PRUNE_EVERY` seconds, delete the
    results past their time (in batches, until none is left)."""

    def __init__(self, engine: Engine, every: float = PRUNE_EVERY) -> None:
        self.engine = engine
        self.every = every
        self._next = 0.0  # at once, at the relay's start

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def step(self, now: datetime) -> int:
        self._next = time.monotonic() + self.every
        total = 0
        while True:
            with db_errors("prune results"), self.engine.begin() as conn:
                gone = prune(conn, now)
            total += gone
            if gone < PRUNE_BATCH:
                return total
