"""What ``@app.task`` returns: the handler, callable exactly as before, that
also schedules its own jobs, with the payload type its handler declares.

::

    @app.task("send-reminder")
    def send_reminder(payload: Reminder, ctx: duebox.JobContext) -> None: ...

    send_reminder.schedule(session, {"order_id": 42}, delay=3600)  # your transaction
    send_reminder.enqueue({"order_id": 42}, delay=3600)            # duebox's own
    send_reminder({"order_id": 42}, ctx)                           # the function itself

A type checker reads the payload's type from the handler's first parameter
(``TaskHandle`` is generic over the handler's own type), so a payload of
another type is an error before anything runs; a handler without
annotations takes any payload.  Everything else is checked at run time as
``app.schedule`` checks it.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, Unpack, overload

from .producer import JobOptions, Target
from .targets import AsyncTarget, SyncTarget
from .tasks import JobContext

F = TypeVar("F", bound=Callable[..., Any])
P = TypeVar("P")

# What a Celery, Dramatiq or RQ user reaches for first, and what it is here.
_PEERS = {
    "delay": "Celery's",
    "apply_async": "Celery's",
    "s": "Celery's",
    "send": "Dramatiq's",
    "send_with_options": "Dramatiq's",
}


class _Producer(Protocol):
    """What a handle uses of its application (``Duebox``, typed by shape so
    this module need not import it)."""

    @overload
    def schedule(self, session: SyncTarget, name: str, payload: Any = None,
                 **options: Unpack[JobOptions]) -> uuid.UUID: ...

    @overload
    def schedule(self, session: AsyncTarget, name: str, payload: Any = None,
                 **options: Unpack[JobOptions]) -> Coroutine[Any, Any, uuid.UUID]: ...

    def enqueue(self, name: str, payload: Any = None,
                **options: Unpack[JobOptions]) -> uuid.UUID: ...

    async def aenqueue(self, name: str, payload: Any = None,
                       **options: Unpack[JobOptions]) -> uuid.UUID: ...


class TaskHandle(Generic[F]):
    """Task ``name`` of an app, as ``@app.task`` returns it: calling it calls
    the handler ``fn`` (kept as ``.fn``); ``schedule``, ``enqueue`` and
    ``aenqueue`` are ``app.schedule``, ``app.enqueue`` and ``app.aenqueue``
    with this task's name, whose ``payload`` must have the type of ``fn``'s
    first parameter."""

    def __init__(self, app: _Producer, name: str, fn: F) -> None:
        # First: it copies fn's attributes, which must not overwrite these
        # (a handle registered again carries its own app, name and fn).
        functools.update_wrapper(self, fn)
        self.app = app
        self.name = name
        self.fn = fn

    if TYPE_CHECKING:
        # To a type checker the handle is called as the handler is: the same
        # parameters, keywords and result.
        __call__: F
    else:
        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

        def __getattr__(self, name):
            peer = _PEERS.get(name)
            if peer is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            raise AttributeError(
                f"task {self.name!r} has no .{name}() ({peer}): call "
                f"{self.__name__}.enqueue(payload, delay=...) to schedule it in a transaction "
                f"of duebox's own, or {self.__name__}.schedule(session, payload, delay=...) "
                "in yours (README, 'Scheduling inside your transaction')")

    def __repr__(self) -> str:
        return f"<TaskHandle {self.name!r} of {self.fn!r}>"

    @overload
    def schedule(self: TaskHandle[Callable[[P, JobContext], Any]], session: SyncTarget,
                 payload: P, **options: Unpack[JobOptions]) -> uuid.UUID: ...

    @overload
    def schedule(self: TaskHandle[Callable[[P, JobContext], Any]], session: AsyncTarget,
                 payload: P, **options: Unpack[JobOptions]
                 ) -> Coroutine[Any, Any, uuid.UUID]: ...

    def schedule(self: TaskHandle[Callable[[P, JobContext], Any]], session: Target,
                 payload: P, **options: Unpack[JobOptions]
                 ) -> uuid.UUID | Awaitable[uuid.UUID]:
        """``app.schedule(session, name, payload, ...)``: a job of this task
        written into the caller's open transaction, never committed here."""
        return self.app.schedule(session, self.name, payload, **options)

    def enqueue(self: TaskHandle[Callable[[P, JobContext], Any]], payload: P,
                **options: Unpack[JobOptions]) -> uuid.UUID:
        """``app.enqueue(name, payload, ...)``: a job of this task, committed
        in a transaction of duebox's own before this returns (not atomic
        with any write of the caller's)."""
        return self.app.enqueue(self.name, payload, **options)

    async def aenqueue(self: TaskHandle[Callable[[P, JobContext], Any]], payload: P,
                       **options: Unpack[JobOptions]) -> uuid.UUID:
        """:meth:`enqueue` on the app's async engine."""
        return await self.app.aenqueue(self.name, payload, **options)
