"""What an ``amqp://`` (or ``amqps://``) URL says, checked (see
:mod:`duebox.brokers.amqp`).

Kept apart from the backend so a URL can be checked without pika.  The
parameters not listed in :data:`OWN_PARAMS` are pika's (``heartbeat``,
``ssl_options``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duebox.errors import ConfigurationError

from ._common import number
from .amqp_hosts import node_urls
from .amqp_pack import DEFAULT_PACK, MAX_PACK_JOBS
from .amqp_tiers import (
    DEFAULT_RADIX,
    MAX_DELAY_MS,
    MAX_PRECISION_MS,
    RADIXES,
    Tiers,
    longest_ms,
    precision_ms,
)
from .amqp_topology import MODES, Topology
from .base import parse_params

OWN_PARAMS = frozenset({"max_delay", "prefix", "delay_mode", "queue_type", "confirm_timeout",
                        "pack", "tier_base", "tier_precision"})


@dataclass(frozen=True)
class AMQPSettings:
    """``topology``: every name, from ``?prefix=`` and ``?queue_type=``.
    ``delay_mode``: ``auto`` (the plugin when the broker has it), ``plugin``
    or ``tiers``.  ``confirm_timeout``: seconds a publish waits for the
    broker's confirms.  ``pack``: how many jobs due now one message carries
    at most (brokers/amqp_pack.py; 1: one per message)."""

    topology: Topology
    delay_mode: str = "auto"
    confirm_timeout: float = 30.0
    pack: int = DEFAULT_PACK

    @classmethod
    def from_url(cls, url: str) -> AMQPSettings:
        node_urls(url)  # the nodes' list, checked
        params = parse_params(url)
        topology = topology_of(params)
        mode = params.get("delay_mode", "auto")
        if mode not in MODES:
            raise ConfigurationError(
                f"broker_url: delay_mode must be one of {', '.join(MODES)} (got {mode!r})")
        return cls(topology=topology, delay_mode=mode,
                   confirm_timeout=number(params, "confirm_timeout", 30.0, low=0.0,
                                          seconds=True, above=True),
                   pack=int(number(params, "pack", DEFAULT_PACK, low=1, high=MAX_PACK_JOBS,
                                   integer=True)))

    @property
    def plugin(self) -> bool | None:
        """Whether delays use the plugin; None: detected at connect."""
        return {"auto": None, "tiers": False, "plugin": True}[self.delay_mode]


def topology_of(params: dict[str, str]) -> Topology:
    """The names alone (all a queue-name check needs)."""
    return Topology(prefix=params.get("prefix", "duebox"),
                    queue_type=params.get("queue_type", "classic"), tiers=tiers_of(params))


def tiers_of(params: dict[str, str]) -> Tiers:
    """The TTL tiers' shape: ``?tier_base=`` (2-16), ``?tier_precision=``
    (seconds, whole milliseconds) and ``?max_delay=`` (seconds), which
    together set how many tier queues a vhost holds (amqp_tiers.py)."""
    radix = int(number(params, "tier_base", DEFAULT_RADIX, low=RADIXES.start,
                       high=RADIXES.stop - 1, integer=True))
    unit = number(params, "tier_precision", 0.001, low=0.001, high=MAX_PRECISION_MS / 1000,
                  seconds=True)
    unit_ms = precision_ms(unit)
    most = longest_ms(unit_ms)
    ceiling = number(params, "max_delay", most / 1000, low=0.0, high=MAX_DELAY_MS / 1000,
                     seconds=True)
    return Tiers(radix=radix, precision_ms=unit_ms,
                 ceiling_ms=min(most, math.ceil(ceiling * 1000 - 1e-6)))
