"""``duebox.Background``: a relay and a worker inside your own asyncio program.

The ``duebox relay`` and ``duebox worker`` commands run each part as its own
process, which is what a production deployment wants (see docs/worker.md,
"Processes").  A small service may instead run both inside its web app's
event loop, started and stopped by the app's lifespan::

    @contextlib.asynccontextmanager
    async def lifespan(api: FastAPI) -> AsyncIterator[None]:
        async with duebox.Background(jobs):
            yield

It lives on the top floor (beside the CLI) because it wires the relay and
the consumers together, which neither may do for the other.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

from duebox.app import Duebox
from duebox.consumers import Worker
from duebox.errors import ConfigurationError
from duebox.relay import Relay

log = logging.getLogger("duebox.background")


class Background:
    """A relay and a worker as tasks of the running event loop, with a clean stop.

    ``relay`` and ``worker``: ``True`` (the default) builds one from the
    app's settings; ``False`` leaves that part to its own process
    (``duebox relay`` / ``duebox worker``); an instance runs the one you
    configured (``worker=duebox.Worker(jobs, concurrency=4)``).

    Leaving the ``async with`` block (or :meth:`stop`) sets their stop event
    and waits: the worker finishes the handlers it started and gives back
    jobs it had taken but not started, the relay hands back the jobs it held.
    A part that ends with an error before that is logged at once, and
    :meth:`stop` raises its error.
    """

    def __init__(self, app: Duebox, *, relay: bool | Relay = True,
                 worker: bool | Worker = True) -> None:
        for name, value, cls in (("relay", relay, Relay), ("worker", worker, Worker)):
            if not isinstance(value, bool | cls):
                raise ConfigurationError(
                    f"{name}: must be True, False or a duebox.{cls.__name__} (got {value!r})")
        self.app = app
        self._want_relay = relay
        self._want_worker = worker
        self.relay: Relay | None = relay if isinstance(relay, Relay) else None
        self.worker: Worker | None = worker if isinstance(worker, Worker) else None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start the parts as tasks of the running loop; returns at once."""
        if self._tasks:
            raise ConfigurationError("Background: already started")
        if self._want_relay is True:
            self.relay = Relay(self.app)
        if self._want_worker is True:
            if not self.app.tasks:
                raise ConfigurationError(
                    "worker: the app registers no tasks, a worker would do nothing "
                    "(register them before starting, or pass worker=False)")
            self.worker = Worker(self.app)
        self._stop = asyncio.Event()
        for part in (self.relay, self.worker):
            if part is not None:
                task = asyncio.create_task(part.run(self._stop), name=f"duebox-{part.name}")
                task.add_done_callback(self._ended)
                self._tasks.append(task)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not self._stop.is_set():
            log.error("%s stopped with an error; the rest keeps running",
                      task.get_name(), exc_info=task.exception())

    async def stop(self) -> None:
        """Stop the parts and wait for them; raises the first error one ended with."""
        self._stop.set()
        tasks, self._tasks = self._tasks, []
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def __aenter__(self) -> Background:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()


__all__ = ["Background"]
