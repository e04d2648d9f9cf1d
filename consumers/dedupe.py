"""Deduplication on the outbox id.

The SQL store inserts ``(consumer, message_id)`` into ``duebox_processed``
inside the handler's own transaction: if the handler's writes commit, so does
the row, and a redelivery finds it and skips the handler.  That makes a
handler's local database effects happen once per job id (invariant 3).
"""

from __future__ import annotations

from typing import Any

from duebox.db import insert_if_absent
from duebox.tables import processed


class SQLDedupeStore:
    """Seen-set in the ``duebox_processed`` table, sharing the handler's transaction."""

    def __init__(self, consumer: str = "duebox") -> None:
        self.consumer = consumer

    def claim_stmt(self, dialect: str, message_id: str, now: Any) -> Any:
        """An insert-if-absent whose row count is 1 the first time only."""
        return insert_if_absent(
            processed,
            {"consumer": self.consumer, "message_id": message_id, "processed_at": now},
            dialect,
            ["consumer", "message_id"],
        )
