"""Your tasks, run in your own tests: in-process, deterministic, on a fake
clock.  docs/testing.md ("Testing your tasks") shows it in use.

::

    from datetime import timedelta
    from duebox.testing import Harness

    def test_a_reminder_goes_out_a_day_later():
        with Harness(app) as h:          # app: your duebox.Duebox
            job_id = send_reminder.enqueue({"order_id": 42}, delay=timedelta(days=1))
            assert h.run_due() == []                        # nothing due yet
            [info] = h.run_due(until=timedelta(days=1))     # a day passes, on the fake clock
            assert info.id == job_id and info.state == "SUCCEEDED"

:class:`Harness` points an app at a fresh SQLite file (migrated), a
``memory://`` broker of its own and a :class:`~duebox.FakeClock`, and puts
the app back as it was afterwards.  :func:`run_due` (and :func:`arun_due`
in an event loop) is the loop of a relay and a worker, in this process and
in turn, never side by side:

1. the relay's pass (duebox.relay.Relay.run_pass: recovery, schedules'
   occurrences, the claim of jobs due by now, their publish);
2. the worker handles every message published, one at a time, in order
   (duebox.Worker.handle: the version-checked start, the handler in its
   transaction, retry or dead letter) — retries due now run in this pass's
   next round;
3. nothing left due now: the clock moves to the next due time (a job's or a
   schedule's fire time) if that is not later than ``until``, and 1.
   again; else the clock moves to ``until`` and the jobs the worker ran are
   returned, as ``app.get_job`` reads them then.

Every job runs at its due time on the fake clock, so ``ctx.due_at``,
lateness and retry delays are exact; what runs is the real code path,
handler transactions, dedupe and results included.  The relay publishes
only what is due (``?max_delay=0`` and no hold window), so a job never
waits in the broker for real time to pass.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

from sqlalchemy import func, select

from . import migrate
from .app import Duebox
from .brokers.memory import MemoryBroker
from .clock import Clock, FakeClock
from .config import Settings
from .consumers import Worker
from .errors import ConfigurationError, ValidationError
from .reads.jobs import JobInfo
from .relay import Relay
from .schedules import occurrences
from .states import JobState
from .tables import job

__all__ = ["Harness", "arun_due", "run_due"]

# Waiting to be handed to the worker: what the next pass may run.
_WAITING = (JobState.SCHEDULED, JobState.DISPATCHING, JobState.ENQUEUED)
# A pass that ran nothing while jobs are due (a catch-up rate limit whose
# bucket refills by the clock): the clock moves on this much, within ``until``.
_NUDGE = timedelta(seconds=1)


def run_due(app: Duebox, until: datetime | timedelta | float | None = None) -> list[JobInfo]:
    """Run every job due by ``until`` (an instant, or a span from now;
    None: now) at its due time, moving the app's :class:`FakeClock` there;
    the jobs run, as they ended.  The app must be on a ``memory://`` broker
    and a FakeClock (:class:`Harness` sets both up).  In an event loop:
    :func:`arun_due`."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ConfigurationError("run_due: called inside an event loop; "
                                 "use `await duebox.testing.arun_due(app, ...)`")

    async def run() -> list[JobInfo]:
        try:
            return await arun_due(app, until)
        finally:
            await app.adispose()  # the async engine's connections belong to this loop

    return asyncio.run(run())


async def arun_due(app: Duebox, until: datetime | timedelta | float | None = None
                   ) -> list[JobInfo]:
    """:func:`run_due` in the running event loop."""
    clock = _fake_clock(app)
    end = _end(clock, until)
    hub_url = _memory_url(app)
    relay = Relay(app, broker=app.broker_at(_no_delay(hub_url), "testing-relay"),
                  name="testing-relay", hold_window=0.0)
    worker = Worker(app, name="testing-worker", concurrency=1, group_commit=1)
    broker = worker.broker
    if not isinstance(broker, MemoryBroker):  # routes to another backend
        raise ConfigurationError("run_due: every queue must be on the memory:// broker "
                                 "(broker_routes name another)")
    ran: dict[uuid.UUID, None] = {}
    while True:
        await relay.run_pass()
        if await _deliver(worker, broker, ran):
            continue  # what they made due now (a retry, an occurrence) runs next
        upcoming = await asyncio.to_thread(_next_due, app)
        now = clock.now()
        if upcoming is None or upcoming > end:
            break
        if upcoming > now:
            clock.advance((upcoming - now).total_seconds())
        elif now + _NUDGE <= end:  # due, yet nothing ran: let time move
            clock.advance(_NUDGE.total_seconds())
        else:
            break
    if end > clock.now():
        clock.advance((end - clock.now()).total_seconds())
    return await asyncio.to_thread(_read, app, list(ran))


async def _deliver(worker: Worker, broker: MemoryBroker, ran: dict[uuid.UUID, None]) -> bool:
    """Hand every message published to the worker, one by one, in due order
    across its queues (then in the order published); whether there was any."""
    deliveries = []
    for queue in worker.queues:
        waiting = broker.hub.queues[queue]
        while not waiting.empty():
            body, mid = waiting.get_nowait()
            deliveries.append((mid, broker.delivery(body, mid)))
    deliveries.sort(key=lambda d: (d[1].message is None,
                                   d[1].message.due_at if d[1].message else 0, d[0]))
    for _, delivery in deliveries:
        if delivery.message is not None:
            ran.setdefault(delivery.message.job_id, None)
        await worker.handle(delivery)
    return bool(deliveries)


def _next_due(app: Duebox) -> datetime | None:
    """The earliest due time of a job waiting to run, or of a schedule's
    next fire."""
    with app.engine.connect() as conn:
        due = conn.execute(select(func.min(job.c.due_at))
                           .where(job.c.state.in_(_WAITING))).scalar()
        fire = occurrences.earliest_due(conn)
    found = [t for t in (due, fire) if t is not None]
    return min(found) if found else None


def _read(app: Duebox, ids: list[uuid.UUID]) -> list[JobInfo]:
    with app.engine.connect() as conn:
        return [app.get_job(conn, i) for i in ids]


def _fake_clock(app: Duebox) -> FakeClock:
    if not isinstance(app.clock, FakeClock):
        raise ConfigurationError("run_due: the app's clock must be a duebox.FakeClock "
                                 "(duebox.testing.Harness sets one)")
    return app.clock


def _memory_url(app: Duebox) -> str:
    url = app.settings.broker_url
    if urlsplit(url).scheme != "memory":
        raise ConfigurationError(f"run_due: the app's broker must be memory:// (got "
                                 f"{urlsplit(url).scheme}://; duebox.testing.Harness sets one)")
    return url


def _no_delay(url: str) -> str:
    """The relay's view of the broker: no native delay, so it claims only
    what is due by the fake clock (the broker's timers run on real time)."""
    parts = urlsplit(url)
    return f"memory://{parts.netloc}?max_delay=0"


def _end(clock: FakeClock, until: datetime | timedelta | float | None) -> datetime:
    now = clock.now()
    if until is None:
        return now
    if isinstance(until, datetime):
        if until.tzinfo is None:
            raise ValidationError("until", "must be timezone-aware", until)
        end = until.astimezone(UTC)
    elif isinstance(until, timedelta):
        end = now + until
    elif isinstance(until, int | float) and not isinstance(until, bool):
        end = now + timedelta(seconds=until)
    else:
        raise ValidationError("until", "must be a datetime, a timedelta or seconds", until)
    if end < now:
        raise ValidationError("until", f"must not be before the clock's now ({now.isoformat()})",
                              until)
    return end


class Harness:
    """An app made testable, and put back afterwards: a SQLite file of its
    own (``database_url`` to choose another, migrated here too), a
    ``memory://`` broker of its own and :attr:`clock`, a
    :class:`~duebox.FakeClock` starting at ``start`` (default: now).  Use it
    as a context manager, or call :meth:`close`."""

    def __init__(self, app: Duebox, *, database_url: str | None = None,
                 start: datetime | None = None) -> None:
        self.app = app
        self._saved: tuple[Settings, Clock] = (app.settings, app.clock)
        self._folder: Path | None = None
        if database_url is None:
            self._folder = Path(tempfile.mkdtemp(prefix="duebox-test-"))
            database_url = f"sqlite:///{self._folder / 'duebox.db'}"
        self.clock = FakeClock(start or datetime.now(UTC))
        if not app.owns_engine:
            self.close()
            raise ConfigurationError("Harness: the app was given an engine of its own "
                                     "(Duebox(engine=...)), which it cannot point elsewhere; "
                                     "build the app for the test with a database_url")
        app.configure(database_url=database_url,
                      broker_url=f"memory://testing-{uuid.uuid4().hex[:12]}",
                      broker_routes={})
        app.clock = self.clock
        migrate.upgrade(app.engine)

    def run_due(self, until: datetime | timedelta | float | None = None) -> list[JobInfo]:
        """:func:`run_due` on this app."""
        return run_due(self.app, until)

    async def arun_due(self, until: datetime | timedelta | float | None = None
                       ) -> list[JobInfo]:
        """:func:`arun_due` on this app."""
        return await arun_due(self.app, until)

    def close(self) -> None:
        """Put the app back as it was: its settings, clock and engine."""
        settings, clock = self._saved
        self.app.configure(database_url=settings.database_url)  # its engines are let go
        self.app.settings = settings
        self.app.clock = clock
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
