"""Backpressure: the relay slows down when the broker signals overload.

Signals, all seen on the publish path so they work for every backend:

* the broker refuses messages (a failed :class:`PublishResult`) or the
  publish raises (SQS throttling that outlasted the backend's own retries,
  a RabbitMQ connection closed while blocked);
* a publish much slower per message than usual: RabbitMQ's flow control and
  ``connection.blocked`` stall publisher confirms, SQS backs off inside the
  backend before it answers, so a stall is the overload signal for brokers
  that absorb it without an error;
* downstream of the broker: handlers failing as *throttled* (HTTP 429, a
  ``Throttled`` raised), which workers count in their registry rows and the
  relay reads with its snapshot (:meth:`Backpressure.downstream`).

The response is AIMD on the relay's claim batch: halve on each signal
(down to ``floor`` of the batch), grow back by ``step`` after each calm
publish; while below full speed the relay also pauses between passes in
proportion, so the broker sees fewer, smaller batches instead of a pile.
"""

from __future__ import annotations

import math
import time


class Backpressure:
    """Additive-increase, multiplicative-decrease factor on dispatch."""

    def __init__(self, *, floor: float = 0.05, step: float = 0.1, slow: float = 5.0,
                 min_stall: float = 0.25) -> None:
        self.floor = floor
        self.step = step
        self.slow = slow  # a publish this many times slower per message is a stall
        self.min_stall = min_stall  # ... and only if it took at least this long
        self.factor = 1.0
        self.signals = 0
        self._per_message: float | None = None
        self._hold_until = -math.inf

    def overload(self) -> None:
        self.factor = max(self.floor, self.factor / 2)
        self.signals += 1

    def downstream(self, hold: float) -> None:
        """Handlers are being throttled: halve, and do not grow back for
        ``hold`` seconds however calm the broker is (it is not the broker
        that is overloaded)."""
        self.overload()
        self._hold_until = time.monotonic() + hold

    def observe(self, n: int, seconds: float, refused: int = 0, error: bool = False) -> None:
        """One publish of ``n`` messages that took ``seconds``."""
        per = seconds / max(1, n)
        usual = self._per_message
        stalled = usual is not None and seconds >= self.min_stall and per > self.slow * usual
        if error or refused or stalled:
            self.overload()
        else:
            if time.monotonic() >= self._hold_until:
                self.factor = min(1.0, self.factor + self.step)
            # The baseline learns from calm publishes only.
            self._per_message = per if usual is None else 0.9 * usual + 0.1 * per

    def limit(self, batch: int) -> int:
        return max(1, math.floor(batch * self.factor))

    def pause(self, interval: float) -> float:
        """Seconds to wait between passes at the current factor (0 at full speed)."""
        return 0.0 if self.factor >= 1.0 else interval * (1.0 - self.factor)
