"""How far ahead the relay claims, assembled in one place.

A claim takes ``SCHEDULED`` jobs due by its horizon (core/leases/claims.py
``due``).  The horizon is ``now`` plus the *reach*: the broker's longest
delay (``max_delay``; unbounded where the broker has none) plus the relay's
hold window, cut to a poll interval when a rate limit shapes dispatch
(relay/scale.py), so a burst reaches the broker at the limited rate instead
of pre-staged in full.  Jobs due before the catch-up threshold are backlog
and left to the rate-limited catch-up claim (relay/catchup.py); a sharded
relay's fence limits every claim to its shards; the lease covers the time a
claimed job may wait in the relay's memory before it is published.

A pipeline asks :meth:`Horizon.window` before each claim and
:meth:`Horizon.reach` to know when the earliest due job comes in reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import ColumnElement

if TYPE_CHECKING:
    from .catchup import CatchUp
    from .scale import ScaleControls


@dataclass(frozen=True, slots=True)
class ClaimWindow:
    """What one claim at ``now`` may take."""

    horizon: datetime  # due by this
    backlog_until: datetime  # due at or before this: backlog, the catch-up claim's
    lease_until: datetime  # long enough for a held job to be published
    fence: ColumnElement[bool] | None  # a sharded relay's owned shards


class Horizon:
    def __init__(self, *, max_delay: float | None, hold_window: float, lease_seconds: float,
                 catchup: CatchUp, scale: ScaleControls) -> None:
        self.max_delay = max_delay
        self.hold_window = hold_window
        self.lease_seconds = lease_seconds
        self.catchup = catchup
        self.scale = scale

    def reach(self) -> float | None:
        """Seconds ahead of now the claim reaches (None: no bound)."""
        reach = None if self.max_delay is None else self.max_delay + self.hold_window
        return self.scale.reach(reach, self.hold_window)

    def window(self, now: datetime, near: float) -> ClaimWindow:
        """The window of a claim at ``now``; ``near``: how soon before their
        due time held jobs are published (the relay's near window while its
        timer runs)."""
        reach = self.reach()
        horizon = (datetime.max.replace(tzinfo=now.tzinfo) if reach is None
                   else now + timedelta(seconds=reach))
        # Long enough for a held job to be published: the nearer of the
        # claim's horizon and the hold window.
        ahead = min(near, (self.max_delay or 0.0) + self.hold_window)
        lease = self.lease_seconds + max(self.hold_window, ahead)
        return ClaimWindow(horizon=horizon, backlog_until=self.catchup.threshold(now),
                           lease_until=now + timedelta(seconds=lease),
                           fence=self.scale.fence(now))


__all__ = ["ClaimWindow", "Horizon"]
