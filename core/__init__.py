"""duebox — durable delayed dispatch on the message broker you already run.

Schedule a job inside your own SQLAlchemy transaction (a transactional
outbox); a relay hands it to the broker with the broker's native delay; a
worker runs it exactly once in effect, never before its due time.
"""

from typing import TYPE_CHECKING

from .app import Duebox
from .clock import Clock, DatabaseClock, FakeClock, SystemClock
from .config import Settings
from .errors import (
    AmbiguousJobError,
    BrokerError,
    ConfigurationError,
    DatabaseError,
    DueboxError,
    JobNotFoundError,
    JobStateError,
    LeaseLostError,
    MessageDecodeError,
    MissingDependencyError,
    NotDueError,
    PermissionDeniedError,
    TablesMissingError,
    UnknownTaskError,
    ValidationError,
)
from .failures import Classifier, FailureClass, Permanent, Throttled, Transient
from .handle import TaskHandle
from .inspect import JobInfo
from .message import JobMessage
from .periodic import Periodic
from .producer import NewJob
from .states import JobState
from .tables import metadata
from .tasks import JobContext, RetryPolicy, Task

__version__ = "0.1.0"

# The relay and the consumer side live in duebox.relay and duebox.consumers,
# above core (core imports nothing from them at import time, and `import
# duebox` loads no broker driver); these names are resolved on first use.
_LAZY = {
    "dedupe": "duebox.consumers.dedupe",
    "SQLDedupeStore": "duebox.consumers.dedupe",
    "RedisDedupeStore": "duebox.consumers.dedupe",
    "DUPLICATE": "duebox.consumers.dedupe",
    "Worker": "duebox.consumers.worker",
    "Relay": "duebox.relay.relay",
    "Background": "duebox.cli.background",
}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from duebox.cli.background import Background
    from duebox.consumers.dedupe import DUPLICATE, RedisDedupeStore, SQLDedupeStore, dedupe
    from duebox.consumers.worker import Worker
    from duebox.relay.relay import Relay


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'duebox' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "DUPLICATE",
    "AmbiguousJobError",
    "Background",
    "BrokerError",
    "Classifier",
    "Clock",
    "ConfigurationError",
    "DatabaseClock",
    "DatabaseError",
    "Duebox",
    "DueboxError",
    "FailureClass",
    "FakeClock",
    "JobContext",
    "JobInfo",
    "JobMessage",
    "JobNotFoundError",
    "JobState",
    "JobStateError",
    "LeaseLostError",
    "MessageDecodeError",
    "MissingDependencyError",
    "NewJob",
    "NotDueError",
    "Periodic",
    "Permanent",
    "PermissionDeniedError",
    "RedisDedupeStore",
    "Relay",
    "RetryPolicy",
    "SQLDedupeStore",
    "Settings",
    "SystemClock",
    "TablesMissingError",
    "Task",
    "TaskHandle",
    "Throttled",
    "Transient",
    "UnknownTaskError",
    "ValidationError",
    "Worker",
    "__version__",
    "dedupe",
    "metadata",
]
