"""The shape of ``amqp://``'s TTL tiers: how a delay becomes digits, and how
many tier queues that takes (see :mod:`duebox.brokers.amqp_topology`).

A delay is counted in units of ``precision_ms`` (rounded *up*: a message is
never delivered early) and written in base ``radix`` with ``levels`` digits;
each non-zero digit ``d`` at position ``j`` is one stop in a queue whose TTL
is ``d * radix**j * precision_ms``.  ``levels`` is the fewest that reach the
ceiling (``ceiling_ms``: 2**32 - 1 ms, RabbitMQ's and the plugin's, or a
lower ``?max_delay=``), and a queue whose TTL alone exceeds the ceiling is
never used, so it is not declared.

The default, base 16 at 1 ms up to 2**32 - 1 ms, takes 8 levels of 15
queues: 120, at most 8 stops a message and no lateness from rounding.  A
vhost that must hold fewer queues trades for them (docs/brokers.md, "How
many tier queues"): base 2 at 1 s precision needs 23 queues, up to 23 stops
(each about a millisecond and a broker write) and up to 1 s of lateness
from rounding up.

Nothing here talks to a broker, and nothing imports pika.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duebox.errors import ConfigurationError

# 2**32 - 1 ms (49.7 days): RabbitMQ's TTL and the delayed-message plugin's
# x-delay are 32-bit unsigned milliseconds.
MAX_DELAY_MS: int = 2**32 - 1
RADIXES = range(2, 17)  # one hexadecimal character a digit in the routing key
DEFAULT_RADIX = 16
# Longer than this, a unit would make every delay needlessly late.
MAX_PRECISION_MS = 60_000


@dataclass(frozen=True)
class Tiers:
    """``radix`` (``?tier_base=``), ``precision_ms`` (``?tier_precision=``
    in seconds) and ``ceiling_ms`` (``?max_delay=``), checked."""

    radix: int = DEFAULT_RADIX
    precision_ms: int = 1
    ceiling_ms: int = MAX_DELAY_MS

    def __post_init__(self) -> None:
        if self.radix not in RADIXES:
            raise ConfigurationError(
                f"broker_url: tier_base must be an integer from {RADIXES.start} to "
                f"{RADIXES.stop - 1} (got {self.radix!r})")
        if not 1 <= self.precision_ms <= MAX_PRECISION_MS:
            raise ConfigurationError(
                "broker_url: tier_precision must be a number of seconds from 0.001 to "
                f"{MAX_PRECISION_MS // 1000} in whole milliseconds (got "
                f"{self.precision_ms / 1000:g})")
        if not 0 <= self.ceiling_ms <= MAX_DELAY_MS:
            raise ConfigurationError(
                f"broker_url: max_delay must be at most {MAX_DELAY_MS / 1000:g} s for the "
                f"tiers (got {self.ceiling_ms / 1000:g})")

    @property
    def default(self) -> bool:
        """The shape whose names carry no suffix (what every release before
        the option declared)."""
        return self == Tiers()

    @property
    def most_units(self) -> int:
        """The longest delay in units: the ceiling, rounded up to a unit."""
        return -(-self.ceiling_ms // self.precision_ms)

    @property
    def levels(self) -> int:
        """The fewest digits that write :attr:`most_units` (at least one)."""
        n = 1
        while self.radix**n - 1 < self.most_units:
            n += 1
        return n

    def ttl_ms(self, j: int, d: int) -> int:
        return int(d * self.radix**j * self.precision_ms)

    def queues(self) -> list[tuple[int, int]]:
        """The (level, digit) of every tier queue a delay may stop in."""
        return [(j, d) for j in range(self.levels) for d in range(1, self.radix)
                if d * self.radix**j <= self.most_units]

    def units(self, ms: int) -> int:
        """``ms`` in whole units, rounded up: never early."""
        return -(-ms // self.precision_ms)

    def digits(self, units: int) -> list[int]:
        """``units`` as :attr:`levels` digits, most significant first."""
        if not 0 <= units <= self.most_units:
            raise ValueError(f"delay of {units} units of {self.precision_ms} ms is outside "
                             f"0..{self.most_units}")
        r = self.radix
        return [(units // r**j) % r for j in range(self.levels - 1, -1, -1)]

    def stops(self, units: int) -> list[tuple[int, int]]:
        """The (level, digit) queues a delay of ``units`` stops in, in order."""
        top = self.levels - 1
        return [(top - i, d) for i, d in enumerate(self.digits(units)) if d]

    def key(self, units: int) -> str:
        return ".".join(f"{d:x}" for d in self.digits(units))

    def at(self, units: int, elapsed_ms: float) -> str:
        """The tier queue (level.digit) a delay of ``units`` sits in
        ``elapsed_ms`` after it was published."""
        stops = self.stops(units)
        passed = 0.0
        for n, (level, digit) in enumerate(stops, 1):
            passed += self.ttl_ms(level, digit)
            if elapsed_ms < passed:
                return f"tier {level}.{digit:x} (stop {n} of {len(stops)})"
        return "its last tier"


def longest_ms(precision_ms: int) -> int:
    """The longest delay these tiers take: whole units within RabbitMQ's
    2**32 - 1 ms (the relay rounds a delay up to a unit, and no tier queue's
    TTL may pass it)."""
    return MAX_DELAY_MS // precision_ms * precision_ms


def precision_ms(seconds: float) -> int:
    """``?tier_precision=`` seconds as whole milliseconds; a fraction of a
    millisecond is refused rather than rounded (it could only be rounded
    away from what was asked)."""
    ms = round(seconds * 1000)
    if not math.isclose(ms, seconds * 1000, abs_tol=1e-6):
        raise ConfigurationError(
            f"broker_url: tier_precision must be a whole number of milliseconds "
            f"(got {seconds:g} s)")
    return ms
