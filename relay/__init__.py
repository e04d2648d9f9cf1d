"""The relay: claim due jobs, publish them with the broker's delay, mark them, recover."""

from .relay import Relay
from .stats import PassStats

__all__ = ["PassStats", "Relay"]
