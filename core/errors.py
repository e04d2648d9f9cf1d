"""The one exception hierarchy of duebox.

Every error duebox raises on purpose is a :class:`DueboxError`; driver errors
(SQLAlchemy, pika, boto3, ...) are converted where they enter, with the
original chained as ``__cause__``::

    DueboxError
    ├── ConfigurationError        bad settings, URLs, --app strings
    │   ├── MissingDependencyError  an optional driver is not installed
    │   └── AccessRefusedError      the database or broker kept refusing the login,
    │                               vhost, database or role: the relay or worker stops (78)
    ├── ValidationError           bad input to the API or a message (names the field)
    │   ├── UnknownTaskError
    │   ├── AmbiguousJobError     an id prefix that names more than one job
    │   └── MessageDecodeError    a broker message that is not a duebox message
    ├── DatabaseError             the database is unreachable or refused a write
    │   ├── PermissionDeniedError   the database role lacks a privilege the action needs
    │   └── TablesMissingError      no duebox tables yet: run `duebox db upgrade`
    ├── BrokerError               the broker is unreachable or refused a publish
    │   └── BrokerUnreachableError  no connection to it (retried)
    │       └── BrokerRefusedError    it answered and refused the connection (retried
    │                                 for a short grace, then AccessRefusedError)
    └── JobStateError             the job is not in a state that allows the action
        ├── JobNotFoundError
        ├── LeaseLostError        a fenced write matched no row: another owner moved on
        ├── NotDueError           your own consumer handed a message over before its due time
        └── WaitTimeoutError      app.wait_for(): the job had not ended within the timeout
"""

from __future__ import annotations

from .states import Discard


class DueboxError(Exception):
    """Root of every error duebox raises on purpose."""


class ConfigurationError(DueboxError):
    """A setting, URL or import string is invalid."""


class MissingDependencyError(ConfigurationError):
    """An optional driver is missing; the message names the pip extra."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"{package} is not installed: install it with `pip install 'duebox[{extra}]'`"
        )
        self.package = package
        self.extra = extra


class ValidationError(DueboxError, ValueError):
    """Bad input: ``field`` names what was wrong, ``rule`` what it must satisfy."""

    def __init__(self, field: str, rule: str, value: object = ...) -> None:
        shown = "" if value is ... else f" (got {_short_repr(value)})"
        super().__init__(f"{field}: {rule}{shown}")
        self.field = field
        self.rule = rule


class UnknownTaskError(ValidationError):
    """A task name that no ``@app.task`` registered."""

    def __init__(self, name: str, known: list[str]) -> None:
        hint = ", ".join(sorted(known)[:10]) or "none registered"
        super().__init__("task", f"must be a registered task name (known: {hint})", name)


class AmbiguousJobError(ValidationError):
    """An id prefix that starts more than one job's id: ``candidates`` are
    some of them, to pick from."""

    def __init__(self, field: str, prefix: str, candidates: list[str], *,
                 more: bool = False) -> None:
        listed = ", ".join(candidates) + (", ..." if more else "")
        super().__init__(field, f"the id prefix {prefix!r} matches several jobs: {listed}; "
                                "give more of the id")
        self.candidates = candidates


class MessageDecodeError(ValidationError):
    """A broker message that cannot be a duebox message.  ``reason`` is what
    the worker counts its discard as (``duebox_jobs_discarded_total``):
    ``undecodable``, ``too_large`` or ``too_deep``."""

    def __init__(self, field: str, rule: str, value: object = ..., *,
                 reason: str = Discard.UNDECODABLE) -> None:
        super().__init__(field, rule, value)
        self.reason = reason


class DatabaseError(DueboxError):
    """The database could not be reached or refused the statement."""


class PermissionDeniedError(DatabaseError):
    """The database refused the statement for lack of a privilege: operator
    actions are restricted with database roles (docs/operators.md)."""

    def __init__(self, action: str, detail: object) -> None:
        super().__init__(
            f"{action}: permission denied: the database role lacks a privilege this action "
            f"needs ({detail}); see docs/operators.md for the grants")
        self.action = action


class TablesMissingError(DatabaseError):
    """The database has no duebox tables (``duebox db upgrade`` was not run
    against it); ``todo`` says how to create them from where the caller is."""

    def __init__(self, action: str, where: str, todo: str) -> None:
        super().__init__(f"{action}: no duebox tables in this database ({where}): {todo}")
        self.action = action


class BrokerError(DueboxError):
    """The broker could not be reached or refused a message."""


class BrokerUnreachableError(BrokerError):
    """No connection to the broker at ``where`` (refused, reset, timed out):
    the relay and the worker retry until it answers."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(f"cannot connect to {where}: {detail}")
        self.where = where
        self.detail = detail


class BrokerRefusedError(BrokerUnreachableError):
    """The broker answered and refused the connection: a login it does not
    know, a vhost that is not there or not permitted.  Waiting rarely mends
    that, but a broker still loading its users does it for a moment: the
    relay and the worker retry for a short grace, then stop
    (:class:`AccessRefusedError`)."""


class AccessRefusedError(ConfigurationError):
    """The database or the broker refused the connection throughout the
    grace (duebox.observability.trouble): a wrong password, an unknown user, role, vhost
    or database.  The ``duebox relay`` and ``worker`` commands stop with
    exit status 78 (EX_CONFIG) and this one line."""


class JobStateError(DueboxError):
    """The job's state does not allow the requested action."""


class JobNotFoundError(JobStateError):
    def __init__(self, job_id: object) -> None:
        super().__init__(f"job {job_id}: no such job")
        self.job_id = job_id


class LeaseLostError(JobStateError):
    """A fenced write matched no row: the lease moved to another owner."""


def _short_repr(value: object, limit: int = 80) -> str:
    if isinstance(value, int) and value.bit_length() > 4 * limit:
        # repr() of an int of more than 4,300 digits raises ValueError.
        return f"an int of about {value.bit_length() * 0.30103:.0f} digits"
    try:
        text = repr(value)
    except Exception:  # a caller's object whose repr() fails: say what it is
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NotDueError(JobStateError):
    """A consumer of your own handed the dedupe decorator a job's message
    before the job's due time (``duebox-due-at``): nothing ran and nothing
    was written.  Requeue or hold the message for ``seconds``."""

    def __init__(self, job_id: object, due_at: object, seconds: float) -> None:
        self.job_id = job_id
        self.due_at = due_at
        self.seconds = seconds
        super().__init__(f"job {job_id}: not due until {due_at} ({seconds:.3f} s from now); "
                         "hold or requeue its message until then")


class WaitTimeoutError(JobStateError, TimeoutError):
    """:meth:`Duebox.wait_for` gave up: the job had not ended within
    ``timeout`` seconds.  ``job`` is the job as last read (a
    :class:`~duebox.JobInfo`): where it was when the wait ended."""

    def __init__(self, job_id: object, timeout: float, job: object) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.job = job
        state = getattr(job, "state", None)
        super().__init__(f"job {job_id}: not finished within {timeout:g} s "
                         f"(still {state})")
