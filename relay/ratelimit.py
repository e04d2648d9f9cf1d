"""Dispatch rate limits shared by every relay and ``sql://`` worker: token
buckets in the database (``duebox_rate_bucket``).

The implementation is ``duebox.fair_claim``'s (core/fair_claim.py), where
both claimers reach it: a claim transaction locks the bucket rows it needs
in name order, refills them by the time elapsed, claims at most what they
allow and writes back what it spent before it commits, so several processes
share one budget exactly and a claim that rolls back spends nothing.
"""

from __future__ import annotations

from duebox.fair_claim import Held, Limit
from duebox.fair_claim import bucket_wait as seconds_until
from duebox.fair_claim import lock_buckets as lock
from duebox.fair_claim import spend_buckets as spend

__all__ = ["Held", "Limit", "lock", "seconds_until", "spend"]
