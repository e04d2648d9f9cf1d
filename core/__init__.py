"""duebox — durable delayed dispatch on the message broker you already run.

Schedule a job inside your own SQLAlchemy transaction (a transactional
outbox); a relay hands it to the broker with the broker's native delay; a
worker runs it exactly once in effect, never before its due time.
"""

from .app import Duebox
from .clock import Clock, FakeClock, SystemClock
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
    UnknownTaskError,
    ValidationError,
)
from .message import JobMessage
from .producer import NewJob
from .states import JobState
from .tables import metadata
from .tasks import JobContext, RetryPolicy, Task

__version__ = "0.1.0"

__all__ = [
    "BrokerError",
    "Clock",
    "ConfigurationError",
    "DatabaseError",
    "Duebox",
    "DueboxError",
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
    "RetryPolicy",
    "Settings",
    "SystemClock",
    "Task",
    "UnknownTaskError",
    "ValidationError",
    "__version__",
    "metadata",
]
