"""The :class:`Duebox` application object: tasks, engines and the producer API."""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, overload

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from .clock import Clock, DatabaseClock
from .config import Settings
from .db import create_async_engine_for, create_sync_engine
from .errors import ConfigurationError, UnknownTaskError, ValidationError
from .failures import DEFAULT_CLASSIFIER, Classifier, ClassRule
from .handle import TaskHandle
from .leases import own_queues
from .observability.tracing import stamp
from .producer import (
    JobOptions,
    NewJob,
    Steps,
    Target,
    cancel_steps,
    check_priority,
    check_size,
    copy_capable,
    dialect_of,
    drive,
    engine_of,
    insert_many_steps,
    insert_steps,
    json_size,
    reschedule_steps,
    resolve_due,
    tables_first,
)
from .reads.jobs import JobInfo, record_steps
from .reads.wait import check_timeout, wait, wait_async
from .registry import (
    broker_class,
    check_broker_url,
    check_queue_name,
    message_limit,
    routed_broker_class,
)
from .routes import Routes
from .schedules.api import Schedules
from .schedules.periodic import Periodic, declarations
from .seam import BrokerContext
from .secret_keys import SecretKeys, parse_mask_keys
from .targets import AsyncTarget, SyncTarget
from .tasks import (
    DEFAULT_MAX_ATTEMPTS,
    Handler,
    RetryPolicy,
    Task,
    check_task_seconds,
    validate_task_options,
)
from .validation import aware, check_json, check_operator, check_optional_str, encode_json

if TYPE_CHECKING:
    from duebox.brokers.base import Broker

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class Duebox:
    """One application: its database (the outbox lives there), its broker and its tasks.

    ``engine`` may be the application's own engine; duebox never disposes of
    an engine it did not create.
    """

    def __init__(
        self,
        database_url: str | None = None,
        broker_url: str | None = None,
        *,
        engine: Engine | None = None,
        clock: Clock | None = None,
        settings: Settings | None = None,
    ) -> None:
        base = settings or Settings()
        self.settings = base.with_(database_url=database_url, broker_url=broker_url)
        if engine is not None and database_url is None:
            self.settings = self.settings.with_(
                database_url=engine.url.render_as_string(hide_password=False)
            )
        check_broker_url(self.settings.broker_url)
        own_queues.check(self.settings.broker_url, self.settings.own_queues)
        self.clock: Clock = clock or DatabaseClock()
        self.tasks: dict[str, Task] = {}
        self._engine = engine
        self._own_engine = engine is None
        self._async_engine: AsyncEngine | None = None
        self._limits: dict[tuple[str, int], tuple[int, str]] = {}
        # Engines whose database was found to hold duebox's tables: the
        # producer API asks once per engine (see _drive).
        self._migrated: weakref.WeakSet[Engine] = weakref.WeakSet()
        self.schedules = Schedules(self)
        # Schedules declared with @app.task(schedule=...), by schedule name:
        # what relays sync into the schedule table at start.
        self.declared_schedules: dict[str, Periodic] = {}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **kw: Any) -> Duebox:
        """Settings from ``DUEBOX_DATABASE_URL`` (default ``sqlite:///duebox.db``),
        ``DUEBOX_BROKER_URL`` (default ``sql://``) and the other ``DUEBOX_*``."""
        return cls(settings=Settings.from_env(environ), **kw)

    def configure(self, **changes: Any) -> None:
        """Change settings (``database_url=``, ``broker_url=``, ``batch_size=`` ...),
        checked like the constructor's; ``None`` values are ignored.  A new
        broker must be able to use every registered task's queue."""
        settings = self.settings.with_(**changes)
        check_broker_url(settings.broker_url)
        own_queues.check(settings.broker_url, settings.own_queues)
        routes = Routes.of(settings.broker_url, settings.routes)
        for task in self.tasks.values():
            check_queue_name(routes.url_for(task.queue), task.queue)
        if settings.database_url != self.settings.database_url and self._own_engine:
            self.dispose()
            # Made for the old database: dropped (an event loop would be
            # needed to close its connections; aiosqlite's are not pooled).
            self._async_engine = None
        self.settings = settings
        for name, task in self.tasks.items():
            self.tasks[name] = replace(task, secret_keys=self._secret_keys(task.mask_keys,
                                                                          settings))

    @staticmethod
    def _secret_keys(own: tuple[str, ...] | None, settings: Settings) -> SecretKeys:
        """A task's secret keys: its own, else the app's ``mask_keys``."""
        return SecretKeys.of(own) if own is not None else settings.secret_keys

    # --- engines -----------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = create_sync_engine(self.settings.database_url)
        return self._engine

    @property
    def owns_engine(self) -> bool:
        """Whether the app made its engine (from ``database_url``), rather
        than being given one (``engine=``): only then does ``configure``
        point it at another database."""
        return self._own_engine

    @property
    def async_engine(self) -> AsyncEngine:
        if self._async_engine is None:
            self._async_engine = create_async_engine_for(self.settings.database_url)
        return self._async_engine

    def dispose(self) -> None:
        if self._engine is not None and self._own_engine:
            self._engine.dispose()
            self._engine = None

    async def adispose(self) -> None:
        if self._async_engine is not None:
            await self._async_engine.dispose()
            self._async_engine = None
        self.dispose()

    @property
    def routes(self) -> Routes:
        """Which broker serves each queue: ``broker_url`` unless
        ``broker_routes`` names another (docs/brokers.md, "Routing")."""
        return Routes.of(self.settings.broker_url, self.settings.routes)

    def broker(self, worker_name: str = "worker", *, queue: str | None = None,
               queues: Sequence[str] | None = None) -> Broker:
        """A broker object (it connects when opened).  ``queue``: the one
        that serves this queue's route.  ``queues``: one that consumes all
        of them, across their routes (a broker per route behind one
        consumer, when they span several).  Neither: the default route's."""
        if queue is not None:
            return self.broker_at(self.routes.url_for(queue), worker_name)
        if queues is not None:
            by_url = self.routes.split(queues)
            if len(by_url) > 1:
                routed: Broker = routed_broker_class()(
                    [(self.broker_at(url, worker_name), qs) for url, qs in by_url.items()],
                    BrokerContext(self.engine, self.clock, self.settings, worker_name))
                return routed
            if by_url:
                return self.broker_at(next(iter(by_url)), worker_name)
        return self.broker_at(self.settings.broker_url, worker_name)

    def broker_at(self, url: str, worker_name: str = "worker") -> Broker:
        """A broker object for ``url``, one of this app's routes."""
        cls = broker_class(url)
        ctx = BrokerContext(self.engine, self.clock, self.settings, worker_name)
        broker: Broker = cls(url, ctx)
        return broker

    # --- tasks -------------------------------------------------------------

    def task(
        self,
        name: str,
        *,
        queue: str | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry: RetryPolicy | None = None,
        lease_seconds: float | None = None,
        classify: Mapping[type[BaseException], ClassRule] | Classifier | None = None,
        timeout: float | None = None,
        validate: Callable[[Any], None] | None = None,
        max_lateness: float | None = None,
        mask: Callable[[Any], Any] | None = None,
        mask_keys: Sequence[str] | str | None = None,
        group_commit: bool = True,
        schedule: str | Periodic | Sequence[Periodic] | None = None,
        timezone: str | None = None,
        store_result: bool = False,
        result_ttl: float | None = None,
    ) -> Callable[[F], TaskHandle[F]]:
        """Register ``fn(payload, ctx)`` (sync or async) as task ``name``.

        Returns a :class:`TaskHandle`: ``fn`` itself to call, with
        ``.schedule(session, payload, ...)``, ``.enqueue(payload, ...)`` and
        ``.aenqueue(payload, ...)`` for this task, whose payload's type a
        type checker takes from ``fn``'s first parameter.

        A failing job is tried ``max_attempts`` times (default 10), waiting
        as ``retry`` says between attempts (default :class:`RetryPolicy`:
        7.5-15 s after the first, doubling to 30-60 minutes, one to two hours
        in all; docs/failures.md, "Backoff").
        ``classify`` maps exception types to failure classes on top of the
        defaults (``{PaymentDeclined: "permanent"}``); ``timeout`` limits one
        execution, separately from the lease; ``validate(payload)`` raises when
        a payload no longer fits the handler and is checked before DLQ replay.
        ``max_lateness``: a job not dispatched within this many seconds of its
        due time (an outage) is EXPIRED by the relay instead of run late.
        ``mask(payload)`` returns the payload as people may see it (the
        dashboard shows that, never the raw payload); then the values of
        secret keys are masked, in the payload and in error text that quotes
        them: the app's ``mask_keys`` setting, or ``mask_keys`` here (``()``
        or ``"none"``: none for this task).
        ``group_commit=False``: each job runs in a transaction of its own, never
        shared with other jobs' (see docs/worker.md, "Group commit").
        ``schedule`` declares a recurring schedule in code: a cron rule
        (evaluated in ``timezone``, default UTC) or :class:`Periodic` values;
        relays create, update and retire such schedules when they start (see
        docs/schedules.md, "Schedules as code").
        ``store_result=True`` keeps what the handler returns, JSON of at most
        the ``max_result_bytes`` setting, for ``result_ttl`` seconds (default
        the ``result_ttl`` setting, a day): ``app.get_job(...).result``,
        ``app.wait_for(job_id)``.  Such a task runs each job in a transaction
        of its own (no group commit); a result that is not JSON or too large
        fails the attempt, permanently (duebox.reads.results).
        """
        queue = queue or "default"
        validate_task_options(name, queue, max_attempts)
        check_queue_name(self.routes.url_for(queue), queue)
        check_task_seconds(timeout=timeout, max_lateness=max_lateness,
                           lease_seconds=lease_seconds)
        for flag, value in (("group_commit", group_commit), ("store_result", store_result)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"{flag}: must be True or False (got {value!r})")
        check_task_seconds(result_ttl=result_ttl)
        if result_ttl is not None and not store_result:
            raise ConfigurationError("result_ttl: keeps a result only with store_result=True")
        own_keys = None if mask_keys is None else parse_mask_keys(mask_keys)
        classifier = (classify if isinstance(classify, Classifier)
                      else DEFAULT_CLASSIFIER.extend(classify or {}))
        declared = declarations(name, schedule, timezone)
        for p in declared:
            other = self.declared_schedules.get(p.name or "")
            if other is not None and other.task != name:
                raise ConfigurationError(f"schedule {p.name!r}: declared by task {other.task!r} "
                                         f"and by task {name!r}; give one another name")

        def register(fn: F) -> TaskHandle[F]:
            # A handle registered again (under another name) runs its function.
            handler = fn.fn if isinstance(fn, TaskHandle) else fn
            self.tasks[name] = Task(
                name=name, fn=handler, queue=queue, max_attempts=max_attempts,
                retry=retry or RetryPolicy(), lease_seconds=lease_seconds,
                classifier=classifier, timeout=timeout, validate=validate,
                max_lateness=max_lateness, mask=mask,
                # A result is written with its job's completion, which a
                # batch's shared statements do not carry: such jobs run alone.
                group_commit=group_commit and not store_result,
                mask_keys=own_keys, secret_keys=self._secret_keys(own_keys, self.settings),
                store_result=store_result, result_ttl=result_ttl,
            )
            # Registering a task again replaces what it declared before.
            for old in [k for k, v in self.declared_schedules.items() if v.task == name]:
                del self.declared_schedules[old]
            for p in declared:
                self.declared_schedules[p.name or name] = p
            return TaskHandle(self, name, fn)

        return register

    def add_task(self, name: str, fn: Handler, **options: Any) -> None:
        self.task(name, **options)(fn)

    def get_task(self, name: str) -> Task:
        if not isinstance(name, str):  # a dict or a NewJob raised TypeError (unhashable)
            hint = ("; a job built with app.new_job() is written with app.schedule_many()"
                    if isinstance(name, NewJob) else "")
            raise ValidationError("task", f"must be a task's name, a str{hint}", name)
        try:
            return self.tasks[name]
        except KeyError:
            raise UnknownTaskError(name, list(self.tasks)) from None

    @property
    def queues(self) -> list[str]:
        return sorted({t.queue for t in self.tasks.values()}) or ["default"]

    # --- producer API ------------------------------------------------------

    def payload_limit(self, queue: str | None = None) -> tuple[int, str]:
        """The largest payload plus headers, in bytes of JSON, that schedule()
        accepts (for ``queue``: on its route's broker), and where that limit
        comes from."""
        url = self.settings.broker_url if queue is None else self.routes.url_for(queue)
        key = (url, self.settings.max_payload_bytes)
        found = self._limits.get(key)
        if found is None:
            found = self._limits[key] = message_limit(url, self.settings.max_payload_bytes)
        return found

    def new_job(
        self,
        name: str,
        payload: Any = None,
        *,
        at: datetime | None = None,
        delay: timedelta | float | None = None,
        key: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        expires_at: datetime | None = None,
        headers: dict[str, Any] | None = None,
    ) -> NewJob:
        """Validate one job's arguments; raises :class:`ValidationError` naming
        the field, before anything is written (duebox.validation has the rules).

        ``at`` is an absolute instant (timezone-aware; compared in UTC).
        ``delay`` counts from the moment the job is written, on the app's
        clock: with the default :class:`DatabaseClock`, the database server's.
        """
        task = self.get_task(name)
        check_queue_name(self.routes.url_for(task.queue), task.queue)
        due_at, span = resolve_due(self.clock.now(), at, delay)
        check_optional_str("key", key, 400)
        check_optional_str("tenant", tenant, 200)
        check_priority(priority)
        expires = aware("expires_at", expires_at) if expires_at is not None else None
        if expires is not None and expires <= due_at:
            raise ValidationError("expires_at", "must be later than the job's due time", expires_at)
        payload_json = encode_json(payload)
        size = json_size(payload_json)
        if headers is not None and not isinstance(headers, dict):
            raise ValidationError("headers", "must be a dict", headers)
        headers = stamp(headers, name, task.queue)  # the trace context, when traced
        headers_json = None
        if headers is not None:
            headers_json = encode_json(headers, "headers")
            size += json_size(headers_json)
        check_size(size, *self.payload_limit(task.queue))
        check_json(payload, "payload")
        if headers is not None:
            check_json(headers, "headers")
        return NewJob(
            task=name, queue=task.queue, payload=payload, due_at=due_at,
            max_attempts=task.max_attempts, key=key, priority=priority, tenant=tenant,
            expires_at=expires, headers=headers, payload_json=payload_json,
            headers_json=headers_json, delay=span,
        )

    # The producer API returns its result for a sync target (Session,
    # Connection) and a coroutine for an async one (AsyncSession,
    # AsyncConnection): the overloads tell a type checker which.

    @overload
    def schedule(
        self, session: SyncTarget, name: str, payload: Any = None, *,
        at: datetime | None = None, delay: timedelta | float | None = None,
        key: str | None = None, priority: int = 0, tenant: str | None = None,
        expires_at: datetime | None = None, headers: dict[str, Any] | None = None,
    ) -> uuid.UUID: ...

    @overload
    def schedule(
        self, session: AsyncTarget, name: str, payload: Any = None, *,
        at: datetime | None = None, delay: timedelta | float | None = None,
        key: str | None = None, priority: int = 0, tenant: str | None = None,
        expires_at: datetime | None = None, headers: dict[str, Any] | None = None,
    ) -> Coroutine[Any, Any, uuid.UUID]: ...

    def schedule(
        self,
        session: Target,
        name: str,
        payload: Any = None,
        *,
        at: datetime | None = None,
        delay: timedelta | float | None = None,
        key: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        expires_at: datetime | None = None,
        headers: dict[str, Any] | None = None,
    ) -> uuid.UUID | Awaitable[uuid.UUID]:
        """Write a job into the caller's open transaction; never commits.

        Returns the job id (await it with an ``AsyncSession``).  With ``key``,
        scheduling the same key again is a no-op that returns the first job's id.
        """
        dialect = dialect_of(session)
        new = self.new_job(
            name, payload, at=at, delay=delay, key=key, priority=priority, tenant=tenant,
            expires_at=expires_at, headers=headers,
        )
        return self._drive(session, "app.schedule",
                           insert_steps(new, dialect, self.clock.now(), self.settings.notify,
                                        self.follows_database))

    def enqueue(self, name: str, payload: Any = None,
                **options: Unpack[JobOptions]) -> uuid.UUID:
        """Schedule a job in a transaction of duebox's own: begun on
        ``app.engine``, committed before this returns, so the job is durable
        (the relay will run it) once you have its id.  For scripts, cron
        jobs, tests: code with no business write of its own.

        What it does not give: atomicity with anything you write.  It is
        not the outbox: if your own transaction later rolls back, the job
        stays scheduled; if this call fails after your commit, your write
        stands without its job.  To have both or neither, write the job in
        your transaction with :meth:`schedule`.  The options are
        :meth:`schedule`'s (``delay``, ``at``, ``key``, ...).  On SQLite,
        do not call it while a transaction of yours holds the write lock: it
        waits for that lock like any other writer.
        """
        with self.engine.begin() as conn:
            return self.schedule(conn, name, payload, **options)

    async def aenqueue(self, name: str, payload: Any = None,
                       **options: Unpack[JobOptions]) -> uuid.UUID:
        """:meth:`enqueue` on ``app.async_engine``, for code in an event loop;
        the same guarantees, and the same lack of atomicity with your
        writes."""
        async with self.async_engine.begin() as conn:
            return await self.schedule(conn, name, payload, **options)

    @overload
    def schedule_many(self, session: SyncTarget, jobs: list[NewJob]) -> list[uuid.UUID]: ...

    @overload
    def schedule_many(self, session: AsyncTarget, jobs: list[NewJob]
                      ) -> Coroutine[Any, Any, list[uuid.UUID]]: ...

    def schedule_many(
        self, session: Target, jobs: list[NewJob]
    ) -> list[uuid.UUID] | Awaitable[list[uuid.UUID]]:
        """Insert many jobs built with :meth:`new_job` in one statement (no keys)."""
        dialect = dialect_of(session)
        for i, new in enumerate(jobs):
            if not isinstance(new, NewJob):
                raise ValidationError(f"jobs[{i}]", "must be built with app.new_job()", new)
            if new.key is not None:
                raise ValidationError(f"jobs[{i}].key", "keys need app.schedule(), one by one")
        copy = dialect == "postgresql" and copy_capable(session)
        return self._drive(session, "app.schedule_many",
                           insert_many_steps(jobs, dialect, self.clock.now(),
                                             self.settings.notify, copy, self.follows_database))

    @overload
    def cancel(self, session: SyncTarget, job_id: uuid.UUID | str, *,
               operator: str | None = None, reason: str | None = None) -> bool: ...

    @overload
    def cancel(self, session: AsyncTarget, job_id: uuid.UUID | str, *,
               operator: str | None = None, reason: str | None = None
               ) -> Coroutine[Any, Any, bool]: ...

    def cancel(
        self, session: Target, job_id: uuid.UUID | str, *, operator: str | None = None,
        reason: str | None = None,
    ) -> bool | Awaitable[bool]:
        """Cancel a job and bump its version; True if it was active (or
        DELIVERED to your own consumer and not yet completed by it).

        A message already handed to a broker for it will be discarded by the
        worker's version check.  With ``operator`` (and then a ``reason``,
        required) an audit row is written.  Cancelling several jobs in one
        transaction: cancel them in id order (``sorted(ids)``), duebox's lock
        order, or the database may abort it as a deadlock with a worker's
        batch (docs/worker.md, "Limits").
        """
        dialect_of(session)
        if operator is not None or reason is not None:
            operator, reason = check_operator(operator, reason)
        return self._drive(session, "app.cancel",
                           cancel_steps(job_id, self.clock.now(), operator, reason))

    @overload
    def reschedule(self, session: SyncTarget, job_id: uuid.UUID | str, *,
                   at: datetime | None = None, delay: timedelta | float | None = None
                   ) -> None: ...

    @overload
    def reschedule(self, session: AsyncTarget, job_id: uuid.UUID | str, *,
                   at: datetime | None = None, delay: timedelta | float | None = None
                   ) -> Coroutine[Any, Any, None]: ...

    def reschedule(
        self, session: Target, job_id: uuid.UUID | str, *, at: datetime | None = None,
        delay: timedelta | float | None = None,
    ) -> Awaitable[None] | None:
        """Move a not-yet-running job to a new due time and bump its version."""
        dialect = dialect_of(session)
        if at is None and delay is None:
            raise ValidationError("at/delay", "give one of at= and delay=")
        due_at, span = resolve_due(self.clock.now(), at, delay)
        return self._drive(session, "app.reschedule",
                           reschedule_steps(job_id, due_at, span, self.clock.now(),
                                            self.settings.notify, dialect,
                                            self.follows_database))

    @overload
    def get_job(self, session: SyncTarget, id_or_key: uuid.UUID | str) -> JobInfo: ...

    @overload
    def get_job(self, session: AsyncTarget, id_or_key: uuid.UUID | str
                ) -> Coroutine[Any, Any, JobInfo]: ...

    def get_job(self, session: Target, id_or_key: uuid.UUID | str
                ) -> JobInfo | Awaitable[JobInfo]:
        """The job with this id, business key, or id prefix (as ``duebox jobs
        list`` prints it): its state, due time, attempts and last error, e.g.
        to show your own users where their job is.  Raises
        :class:`JobNotFoundError`, or :class:`AmbiguousJobError` for a prefix
        that starts several ids."""
        dialect_of(session)
        return self._drive(session, "app.get_job", record_steps(id_or_key))

    def wait_for(self, id_or_key: uuid.UUID | str, *, timeout: float = 60.0) -> JobInfo:
        """Wait until the job has ended (SUCCEEDED, DEAD, CANCELLED, EXPIRED,
        or DELIVERED to a consumer of your own) and return it as
        :meth:`get_job` does, its ``result`` included; raises
        :class:`WaitTimeoutError` (a :class:`DueboxError`) after ``timeout``
        seconds of real time.  Reads the job every 10 ms at first, every
        half second after a few seconds, each time in a transaction of its
        own on ``app.engine`` (core/reads/wait.py)."""
        seconds = check_timeout(timeout)

        def read() -> JobInfo:
            with self.engine.connect() as conn:
                return self.get_job(conn, id_or_key)

        return wait(read, id_or_key, seconds)

    async def wait_for_async(self, id_or_key: uuid.UUID | str, *,
                             timeout: float = 60.0) -> JobInfo:  # noqa: ASYNC109 - Celery's word
        """:meth:`wait_for` in an event loop, on ``app.async_engine``."""
        seconds = check_timeout(timeout)

        async def read() -> JobInfo:
            async with self.async_engine.connect() as conn:
                return await self.get_job(conn, id_or_key)

        return await wait_async(read, id_or_key, seconds)

    def _drive(self, session: Target, action: str, steps: Steps[T]) -> T | Awaitable[T]:
        """Run the producer's ``steps`` on the caller's ``session``; the first
        time on an engine, after checking that duebox's tables are there, so
        that a database nobody ran ``duebox db upgrade`` against gets one
        line saying so (TablesMissingError), not the database's traceback,
        and the caller's transaction stays usable.  Later calls on the engine
        only look it up in a set."""
        engine = engine_of(session)
        if engine not in self._migrated:
            steps = tables_first(steps, action, engine, self._migrated.add)
        return drive(session, steps)

    # --- consumers of your own (docs/own-consumers.md) ---------------------

    def broker_queue_name(self, queue: str) -> str:
        """The name under which the broker holds ``queue``'s messages, for a
        consumer of your own: ``duebox.q.emails`` (amqp://, ``prefix``),
        ``duebox-emails`` (sqs://), ``duebox.emails`` (kafka://, a topic),
        ``duebox:{emails}:ready`` (redis://, a stream).  No network call;
        raises :class:`ConfigurationError` for sql:// and memory://, and
        :class:`ValidationError` (field ``queue``) for a name the broker
        cannot use."""
        check_queue_name(self.settings.broker_url, queue)
        return self.broker("names").queue_name(queue)

    async def adeclare_broker(self, queues: Sequence[str] | None = None) -> dict[str, str]:
        """Create ``queues``' topology on the broker now (queue and bindings,
        topic, stream and consumer group), as the relay's first publish would,
        so a consumer of your own started first finds it.  Idempotent.  By
        default the ``own_consumer_queues`` setting, else every registered
        task's queue.  Returns ``{queue: broker name}``."""
        chosen = list(dict.fromkeys(queues if queues is not None
                                    else self.settings.own_queues or self.queues))
        for q in chosen:
            check_queue_name(self.settings.broker_url, q)
        broker = self.broker("declare")
        try:
            await broker.open()
            names = await broker.declare(chosen)
        finally:
            await broker.close()
        return dict(zip(chosen, names, strict=True))

    def declare_broker(self, queues: Sequence[str] | None = None) -> dict[str, str]:
        """:meth:`adeclare_broker`, for code outside an event loop."""
        import asyncio

        return asyncio.run(self.adeclare_broker(queues))

    @property
    def follows_database(self) -> bool:
        """Whether the app's clock is the database's (the default), so that
        delays are better counted by the database itself."""
        return isinstance(self.clock, DatabaseClock)
