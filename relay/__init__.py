"""The relay: claim due jobs, publish them with the broker's delay, mark them, recover."""

from .relay import PassStats, Relay

__all__ = ["PassStats", "Relay"]
