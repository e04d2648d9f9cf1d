"""What the producer API writes into: the caller's own open transaction.

Every method that takes a ``session`` accepts either form and never commits.
With a sync target it returns its result; with an async one it returns a
coroutine to ``await``.  The ``@overload``s on those methods are written with
these two aliases, so a type checker knows which one a call returns::

    job_id = app.schedule(session, "send-reminder", {...})        # uuid.UUID
    job_id = await app.schedule(async_session, "send-reminder")   # uuid.UUID
"""

from __future__ import annotations

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

SyncTarget = Session | Connection
AsyncTarget = AsyncSession | AsyncConnection

__all__ = ["AsyncTarget", "SyncTarget"]
