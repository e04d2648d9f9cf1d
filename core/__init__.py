"""duebox — durable delayed dispatch on the message broker you already run.

Schedule a job inside your own SQLAlchemy transaction (a transactional
outbox); a relay hands it to the broker with the broker's native delay; a
worker runs it exactly once in effect, never before its due time.
"""

from .app import Duebox
from .clock import Clock, DatabaseClock, FakeClock, SystemClock
from .config import Settings
from .errors import (
    BrokerError,
    ConfigurationError,
    DatabaseError,
    DueboxError,
    JobNotFoundError,
    JobStateError,
    LeaseLostError,
    MessageDecodeError,
    MissingDependencyError,
    PermissionDeniedError,
    UnknownTaskError,
    ValidationError,
)
from .failures import Classifier, FailureClass, Permanent, Throttled, Transient
from .message import JobMessage
from .producer import NewJob
from .states import JobState
from .tables import metadata
from .tasks import JobContext, RetryPolicy, Task

__version__ = "0.1.0"

# The consumer side lives in duebox.consumers (core imports nothing from it
# eagerly); these names are resolved on first use.
_LAZY = {
    "dedupe": "duebox.consumers.dedupe",
    "SQLDedupeStore": "duebox.consumers.dedupe",
    "RedisDedupeStore": "duebox.consumers.dedupe",
    "DUPLICATE": "duebox.consumers.dedupe",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'duebox' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "DUPLICATE",
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
    "JobMessage",
    "JobNotFoundError",
    "JobState",
    "JobStateError",
    "LeaseLostError",
    "MessageDecodeError",
    "MissingDependencyError",
    "NewJob",
    "Permanent",
    "PermissionDeniedError",
    "RedisDedupeStore",
    "RetryPolicy",
    "SQLDedupeStore",
    "Settings",
    "SystemClock",
    "Task",
    "Throttled",
    "Transient",
    "UnknownTaskError",
    "ValidationError",
    "__version__",
    "dedupe",
    "metadata",
]
