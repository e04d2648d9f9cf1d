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
    AccessRefusedError,
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
    WaitTimeoutError,
)
from .failures import Classifier, FailureClass, Permanent, Throttled, Transient
from .handle import TaskHandle
from .message import JobMessage
from .producer import NewJob
from .reads.jobs import JobInfo
from .schedules.periodic import Periodic
from .states import JobState
from .tables import metadata
from .tasks import JobContext, RetryPolicy, Task

__version__ = "0.1.0"

# The built-in broker backends, each registered by URL scheme with a function
# that imports it on first use (no driver is imported here): the one import
# of the package's face from a floor above core besides duebox.above.
from .brokers import schemes as _schemes  # noqa: F401  (after core: it imports core)

if TYPE_CHECKING:  # what the names from the floors above are, for type checkers and IDEs
    from .above import (
        DUPLICATE,
        Background,
        RedisDedupeStore,
        Relay,
        SQLDedupeStore,
        Worker,
        dedupe,
    )

# The names duebox.above holds, imported on first use: `import duebox` loads
# neither the worker nor the relay nor the CLI.
_ABOVE = frozenset({"DUPLICATE", "Background", "RedisDedupeStore", "Relay", "SQLDedupeStore",
                    "Worker", "dedupe"})


def __getattr__(name: str) -> object:
    if name not in _ABOVE:
        raise AttributeError(f"module 'duebox' has no attribute {name!r}")
    from . import above

    return getattr(above, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_ABOVE})


__all__ = [
    "DUPLICATE",
    "AccessRefusedError",
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
    "WaitTimeoutError",
    "Worker",
    "__version__",
    "dedupe",
    "metadata",
]
