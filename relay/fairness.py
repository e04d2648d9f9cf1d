"""Fair dispatch for the relay: what share of each claim batch every class of
jobs gets.

The policy, the share arithmetic, aging and the shared buckets live in
``duebox.fair_claim`` (core/fair_claim.py), because ``sql://`` workers claim
with the same policy (brokers/sql.py); this module adds the relay's step:
the picked rows become ``DISPATCHING``.  In short:

* **Weighted fair shares** by queue weight, split equally among a queue's
  tenants, carried across batches as deficits: every class with due jobs
  makes progress.
* **Reserved capacity** per queue, before weights divide the rest; slots a
  class cannot use go to the others (work conserving).
* **Quotas and rate limits**: token buckets in the database, shared by every
  relay and worker (relay/ratelimit.py).
* **Aging**: ``priority + floor(waited / aging_step)`` within a group.

Every read is bounded and index-backed (core/fair_claim.py).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, Connection

from duebox import jobstore
from duebox.fair_claim import (
    BatchReport,
    DispatchPolicy,
    FairPicker,
    Group,
    effective_priority,
    plan,
)

__all__ = ["BatchReport", "DispatchPolicy", "FairClaim", "Group", "effective_priority", "plan"]


class FairClaim(FairPicker):
    """The relay's claim when a :class:`DispatchPolicy` is enabled."""

    def claim(
        self, conn: Connection, *, owner: str, horizon: datetime, after: datetime | None,
        now: datetime, lease_until: datetime, limit: int,
        fence: ColumnElement[bool] | None = None,
    ) -> list[jobstore.JobRecord]:
        ids = self.pick(conn, horizon=horizon, after=after, now=now, limit=limit, fence=fence)
        records = jobstore.claim_selected(conn, ids, owner=owner, now=now,
                                          lease_until=lease_until, fence=fence)
        records.sort(key=lambda r: (r.due_at, r.id))
        return records
