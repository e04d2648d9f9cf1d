"""The public API's names that live on the floors above core: the worker,
the relay, running them in-process, and the dedupe decorator.

The package ``duebox`` hands these on (``duebox.Worker``, ...) and imports
this module only when one of them is first used, so ``import duebox``
loads neither loop, the CLI nor a broker driver.  This module itself is on
the top floor, beside ``__main__`` (pyproject.toml's contracts): it may
import every floor, and nothing in the package imports it but the package's
own face.
"""

from .cli.background import Background
from .consumers.dedupe import DUPLICATE, RedisDedupeStore, SQLDedupeStore, dedupe
from .consumers.worker import Worker
from .relay.relay import Relay

__all__ = ["DUPLICATE", "Background", "RedisDedupeStore", "Relay", "SQLDedupeStore", "Worker",
           "dedupe"]
