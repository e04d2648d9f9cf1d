"""The relay: one process that moves due jobs from the database to brokers.

It holds a dispatch pipeline per broker it publishes to (relay/pipeline.py:
claim, publish, mark, hold, reconcile): one on a single broker, one per
publishing route with ``broker_routes`` (docs/brokers.md, "Routing"), none
on ``sql://``, whose workers claim rows from the job table themselves.
What keeps every job moving whatever the brokers, it does once:

* **recover** expired leases (plus a clock-skew margin) back to
  ``SCHEDULED`` and **take over** at once the jobs of processes found dead
  by their liveness lock, a dead worker's messages handed on through each
  broker (relay/recovering.py);
* **expire** jobs too late to run (relay/catchup.py);
* **generate** due schedule occurrences, after syncing the schedules
  declared in code (relay/schedules.py);
* **move** jobs left on a broker that no longer serves their queue
  (relay/rerouting.py), and keep the planner's statistics fresh;
* **delete** job results kept past their ``result_ttl``, once a minute
  (core/reads/results.py);
* hold its **shard** leases (relay/shards.py), its registry row and its
  liveness lock, and take the database snapshot behind the state gauges.

:meth:`Relay.run` runs these steps in a loop of its own and each pipeline
in a task of its own, all woken by one LISTEN connection (PostgreSQL's
``NOTIFY``); a step that made jobs due wakes the pipelines.
:meth:`Relay.run_pass` runs the steps, then each pipeline's pass, in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from duebox.brokers.base import Broker, PublishingBroker
from duebox.credentials import redacted
from duebox.db import PgWaker, parse_database_url
from duebox.errors import ConfigurationError, DatabaseError
from duebox.fairness.policy import DispatchPolicy
from duebox.ids import process_token
from duebox.metrics import DBCollector, Metrics, process_metrics
from duebox.observability.logs import CollapsedLog
from duebox.planner_stats import PlannerStats
from duebox.processes.heartbeat import ProcessHeartbeat, ProcessRow
from duebox.reads.results import Pruning
from duebox.routes import Route, describe
from duebox.timing import NEAR_WINDOW_SECONDS

from .catchup import expire_too_late
from .pipeline import DispatchOptions, Pipeline, keep_passing
from .recovering import LeaseRecovery
from .rerouting import Rerouting
from .schedules import ScheduleStep
from .shards import ShardConfig, ShardOwner
from .stats import PassStats, RelayMetrics, RelayTotals, collect, figures

if TYPE_CHECKING:
    from duebox.app import Duebox

log = logging.getLogger("duebox.relay")

# How long a stopping relay waits for its pipelines to finish by themselves.
_STOP_GRACE_SECONDS = 10.0


class Relay:
    """Moves due jobs from the database to the broker, through a pipeline
    per broker (``pipelines``; none on ``sql://``).  Run as many as you
    like: ``SKIP LOCKED`` partitions the rows between them."""

    def __init__(
        self,
        app: Duebox,
        *,
        broker: Broker | None = None,
        batch_size: int | None = None,
        name: str | None = None,
        hold_window: float | None = None,
        recover_interval: float = 1.0,
        reconcile_interval: float = 300.0,
        metrics: Metrics | None = None,
        heartbeat_interval: float = 5.0,
        collect_interval: float = 5.0,
        near_window: float = NEAR_WINDOW_SECONDS,
        lead: float | None = None,
        policy: DispatchPolicy | None = None,
        shards: ShardConfig | None = None,
    ) -> None:
        self.app = app
        self.name = name or process_token("relay")
        self.batch_size = batch_size or app.settings.batch_size
        shards = shards or ShardConfig.from_env()
        if broker is None and app.routes.active and shards is not None:
            raise ConfigurationError(
                "shards: a relay with broker_routes is not sharded (yet); run one relay "
                "per route's shards with broker= instead, or unset DUEBOX_SHARDS")
        served = _served(app, self.name, broker)
        # The registry row's and the metrics' name for what this relay serves.
        self.backend = "routes" if len(served) > 1 else served[0][1].capabilities.name
        self._serves = ("routes: " + "; ".join(describe([r for r, _ in served]))
                        if len(served) > 1 else
                        f"{redacted(app.settings.broker_url)} (max_delay={served[0][1].max_delay})")
        publishing = [(r, b) for r, b in served if isinstance(b, PublishingBroker)]
        if shards is not None and not publishing:
            raise ConfigurationError(
                f"shards: sharding fences a relay's claim for a broker; on {self.backend}:// "
                "workers claim rows from the job table themselves and are not sharded "
                "(SKIP LOCKED partitions the rows between them): pass no shards")
        # Operating at scale (docs/scale.md): one dispatch policy and one set
        # of shard leases for the process, which every pipeline's claim obeys.
        self.policy = policy or DispatchPolicy.configured(app.settings)
        self.shards = (ShardOwner(shards, self.name, app.settings.clock_skew_margin)
                       if shards is not None else None)
        metrics = metrics or process_metrics()
        options = DispatchOptions(self.batch_size, hold_window, near_window, lead,
                                  reconcile_interval, self.policy)
        claims = itertools.count()  # claim owners stay unique in the process
        self.pipelines = [Pipeline(app, self.name, b, route, options, claims=claims,
                                   shards=self.shards, metrics=metrics)
                          for route, b in publishing]
        # A relay given its broker serves what it was given, not the app's
        # routes: it moves no job between routes.
        self.rerouting = Rerouting(app, self.batch_size, active=broker is None)
        self.recovery = LeaseRecovery(app, [p.broker for p in self.pipelines], self.batch_size,
                                      self.name, recover_interval)
        self.schedules = ScheduleStep(app, self.batch_size, process=self.name)
        # PostgreSQL: the job table's planner statistics kept fresh through a
        # burst (core/planner_stats.py).
        self.planner_stats = PlannerStats(app.engine)
        # Results kept past their result_ttl, deleted (core/reads/results.py).
        self.results = Pruning(app.engine)
        # Observability (docs/observability.md): event metrics, the periodic
        # database snapshot and this relay's registry row.
        self.observe = RelayMetrics(metrics, self.backend)
        self.collector = DBCollector(metrics, interval=collect_interval)
        self._log = CollapsedLog(log)
        self.heartbeat = ProcessHeartbeat(
            app.engine, app.clock, role="relay", name=self.name, interval=heartbeat_interval,
            info=self._info, tick=functools.partial(collect, app, self.collector, self._workers),
            tick_interval=collect_interval)

    def _info(self) -> dict[str, object]:
        """This relay's registry row: its figures (its pipelines' summed), each
        pipeline's under ``routes``, and the routes it follows
        (relay/rerouting.py)."""
        info: dict[str, object] = {"role": "relay", **figures(self.backend, self.totals),
                                   "routes": [p.info() for p in self.pipelines]}
        if self.rerouting.active:
            info["routing"] = self.rerouting.fingerprint
        return info

    def _workers(self, processes: Iterable[ProcessRow], interval: float) -> None:
        """What the workers report (throttled handlers) slows every pipeline."""
        seen = list(processes)
        for p in self.pipelines:
            p.scale.observe_workers(seen, interval)

    @property
    def metrics(self) -> Metrics:
        return self.observe.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        for observe in (self.observe, *(p.observe for p in self.pipelines)):
            observe.use(metrics)

    @property
    def totals(self) -> RelayTotals:
        return RelayTotals.sum([self.observe.totals, *(p.observe.totals for p in self.pipelines)])

    # --- one pass ------------------------------------------------------------

    async def run_pass(self) -> PassStats:
        """One pass: the relay's own steps, then each pipeline's pass in turn
        (a relay driven pass by pass, as tests and benchmarks do; :meth:`run`
        runs them side by side)."""
        stats = await self._own_steps()
        for p in self.pipelines:
            stats.add(await p.run_pass())
        return stats

    async def _own_steps(self) -> PassStats:
        """The relay's steps, whatever its brokers: recovery and takeover,
        too-late jobs, schedule occurrences, jobs moved between routes,
        planner statistics, shard leases.  Jobs they made due wake the
        pipelines."""
        stats = PassStats()
        if self.recovery.wait() <= 0:
            working = [p.working_since for p in self.pipelines if p.working_since is not None]
            for recovered in await self.recovery.step(min(working, default=None)):
                stats.recovered += recovered.total
                self.observe.recovered({kind: getattr(recovered, kind) for kind in
                                        ("dispatching", "running", "dead", "enqueued")})
            stats.expired += await asyncio.to_thread(expire_too_late, self.app, self.batch_size)
        stats.occurrences = await self.schedules.run()
        stats.rerouted = await self.rerouting.step()
        if self.planner_stats.due():
            await asyncio.to_thread(self.planner_stats.step)
        if self.results.due():
            await asyncio.to_thread(self.results.step, self.app.clock.now())
        took_shards = await self._step_shards()
        # A relay that dispatches counts its pipelines' passes; one that does
        # not (sql://), its own.
        self.observe.add(stats, a_pass=not self.pipelines)
        if took_shards or stats.recovered or stats.occurrences or stats.rerouted:
            for p in self.pipelines:
                p.wake()
        return stats

    async def _step_shards(self) -> bool:
        """Renew, give back and take shard leases (never one with held jobs);
        whether it took any."""
        if self.shards is None:
            return False
        had = set(self.shards.owned)
        busy = {self.shards.shard_of_job(i) for p in self.pipelines for i in p.held.ids()}
        await asyncio.to_thread(self.shards.step, self.app.engine, self.app.clock.now(), busy)
        self.shards.observe(self.metrics)
        return not set(self.shards.owned) <= had

    def _seconds_until_next(self) -> float:
        waits = [self.app.settings.poll_interval, self.recovery.wait()]
        if self.schedules.pending or self.rerouting.pending:
            waits.append(0.0)
        return max(0.0, min(waits))

    # --- the loop --------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None,
                  waker: PgWaker | None = None) -> None:
        """Run until ``stop`` is set: the relay's own steps in a loop, each
        pipeline in a task of its own.  Whatever a pass raises is logged and
        retried (relay/pipeline.py, ``keep_passing``); only a configuration
        error ends the relay.  ``waker``: the one LISTEN connection every
        loop of this relay follows."""
        stop = stop or asyncio.Event()
        waker = waker or PgWaker(parse_database_url(self.app.settings.database_url))
        # The liveness lock and registry row come before the first claim.
        await asyncio.to_thread(self.heartbeat.register)
        await waker.start()
        beating = asyncio.create_task(self.heartbeat.run(stop), name="duebox-relay-heartbeat")
        gc.freeze()  # as the worker does (consumers/worker.py): no long full collections
        log.info("relay %s started: %s -> %s", self.name,
                 redacted(self.app.settings.database_url), self._serves)
        halt = asyncio.Event()  # the pipelines' stop: set once this loop ended
        running = [self._start(p, halt, waker) for p in self.pipelines]
        try:
            await keep_passing(functools.partial(self._own_pass, running), stop, waker.event,
                               self.observe, self._log)
        finally:
            await self._stop(halt, running)
            await self.heartbeat.stop(beating)
            if self.shards is not None:
                with contextlib.suppress(DatabaseError):
                    await asyncio.to_thread(self.shards.release_all, self.app.engine)
            await waker.stop()
            log.info("relay %s stopped", self.name)

    def _start(self, pipeline: Pipeline, halt: asyncio.Event,
               waker: PgWaker) -> asyncio.Task[None]:
        task = asyncio.create_task(pipeline.run(halt, waker.follower()),
                                   name=f"duebox-relay-pipeline-{pipeline.backend}")
        # One that ends by itself (a configuration error: the others would
        # meet it too) wakes this loop, which raises it.
        task.add_done_callback(lambda _: waker.event.set())
        return task

    async def _own_pass(self, running: list[asyncio.Task[None]]) -> float:
        for t in running:
            ended = t.exception() if t.done() and not t.cancelled() else None
            if ended is not None:
                raise ended
        await self._own_steps()
        return self._seconds_until_next()

    @staticmethod
    async def _stop(halt: asyncio.Event, running: list[asyncio.Task[None]]) -> None:
        """Stop every pipeline: each marks what its broker confirmed and gives
        its held jobs back; one still connecting to an unreachable broker
        (nothing of it to give back) is cancelled after a grace period."""
        halt.set()
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=_STOP_GRACE_SECONDS)
        for t in late:
            t.cancel()
        for t in running:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await t


def _served(app: Duebox, name: str, given: Broker | None) -> list[tuple[Route, Broker]]:
    """Each broker the relay serves, with the route it serves there: the one
    it was given (every queue), or else each route of the app's, the default
    route first."""
    if given is not None:
        return [(Route(given.url, default=True), given)]
    return [(route, app.broker_at(route.url, name)) for route in app.routes.all()]


__all__ = ["Relay"]
