"""How the worker runs each job — alone, or with others in one transaction
— decided here, in one place, from what each task's handlers have shown.

A batch (consumers/batch.py) saves a transaction per job: under a backlog
of short handlers that, not the handlers, bounds a worker.  Its risk is a
handler that runs long: the jobs behind it in its batch wait.  So:

- only jobs of tasks whose handlers are known to be short take the batch
  lane (a task's first jobs, tasks that run long and ``async``, timed or
  opted-out ones take the usual path, alone, with heartbeats);
- a batched handler that has run longer than :meth:`Policy.straggler_after`
  is a *straggler*: its batch lets it go and commits without it, and its
  thread no longer counts as free (consumers/runner.py);
- a task whose straggler could not be let go — it had written through
  ``ctx.session`` into the batch's transaction before it ran long — runs
  alone for :data:`ISOLATE_FOR` seconds after, so that its next slow run
  holds only its own job.

Run times are learnt per task, smoothed, from the runs that were not
stragglers: a usually fast task stays short for batching however long its
rare slow runs are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from duebox.message import ORDERING_KEY_HEADER
from duebox.observability import tracing
from duebox.tasks import Task

# A batch starts no further handler once it has run this long: its commit
# (and the locks it holds) should not wait on more than a few short jobs.
BUDGET = 0.05
# Fewer waiting *started* jobs than this run one by one: a group's fixed
# statements (dedupe rows, lock, completion) and a savepoint per handler cost
# more than a job alone (one statement before the handler, one after, the
# commit) until about six jobs share them.  Measured in one thread on
# PostgreSQL, CPU per no-op job: alone 630-850 us; groups of 2: 965-1,460,
# of 4: ~970, of 8: 485-750.
GROUP_LEAST = 6
# A batched handler running this long, or four times its task's usual time
# if that is longer, is a straggler.  Letting it go costs its batch one
# commit; the jobs behind it start this much late at most.
STRAGGLER_AFTER = 0.01
# A handler alone holds no job but its own: its executor counts as taken by
# a long handler (the worker takes in less, and with every executor so taken
# hands on what waits) only after this long, or four times its task's usual
# time.  A handler that writes to a busy database takes tens of ms.
LONG_ALONE_AFTER = 0.1
# A task whose straggler held its batch's transaction runs alone this long.
ISOLATE_FOR = 60.0
# After a straggler, lane batches spread over every free thread this long.
SPREAD_FOR = 1.0
# Smoothing of run times: the weight of the newest run.
_WEIGHT = 0.2


class Policy:
    """Per worker: what its tasks' handlers have shown, and the decisions
    made from it."""

    def __init__(self, concurrency: int, group: int) -> None:
        self.concurrency = concurrency
        self.group = group
        # The module's figures, per worker (a test may widen them).
        self.budget = BUDGET
        self.group_least = GROUP_LEAST
        self.straggler_floor = STRAGGLER_AFTER
        self.long_alone_floor = LONG_ALONE_AFTER
        # Batched handlers' usual seconds per job (None: none ran yet): how
        # many jobs a free thread takes in hand.
        self.pace: float | None = None
        # Per task, its handlers' usual seconds (stragglers left out).
        self.task_pace: dict[str, float] = {}
        # Per task, until when (monotonic) its jobs run alone.
        self._isolated: dict[str, float] = {}
        # When (monotonic) a batched handler last ran long (None: never).
        self._straggled_at: float | None = None

    # --- what may share a transaction ----------------------------------------------

    def groups(self, task: Task) -> bool:
        """Whether the task's jobs may share a transaction at all: a sync
        handler without a timeout (a shared transaction cannot be cut short
        for one of them), not opted out, on a worker with group commit on."""
        return (self.group > 1 and task.group_commit and task.timeout is None
                and not task.is_async and not self.isolated(task.name))

    def short(self, task: Task) -> bool:
        """Whether the task's handlers are known to take less than the
        batch budget (the batch lane takes only those)."""
        pace = self.task_pace.get(task.name)
        return pace is not None and pace <= self.budget

    def laneable(self, task: Task | None, headers: Mapping[str, object] | None) -> bool:
        """Whether a due job of ``task`` may run in the batch lane: it may
        share a transaction, its handlers are known to be short, no
        ordering key (keys keep their line on the usual path,
        consumers/turns.py), tracing off (the usual path makes the spans)."""
        return (task is not None and self.groups(task) and self.short(task)
                and (not headers or headers.get(ORDERING_KEY_HEADER) in (None, ""))
                and not tracing.enabled())

    def isolated(self, task: str) -> bool:
        until = self._isolated.get(task)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._isolated[task]
        return False

    # --- stragglers -----------------------------------------------------------------

    def straggler_after(self, task: str, *, batched: bool = True) -> float:
        """Seconds after which a handler of ``task`` is a straggler (one
        alone: long, see :data:`LONG_ALONE_AFTER`)."""
        pace = self.task_pace.get(task)
        floor = self.straggler_floor if batched else self.long_alone_floor
        return floor if pace is None else max(floor, 4 * pace)

    def straggled(self) -> None:
        """A batched handler ran past its straggler time (it was let go, or
        held its batch)."""
        self._straggled_at = time.monotonic()

    def straggling(self) -> bool:
        """Whether a batched handler ran long within :data:`SPREAD_FOR`: the
        jobs waiting may be of the same kind, so they spread over every
        free thread instead of gathering into two batches."""
        at = self._straggled_at
        return at is not None and time.monotonic() - at < SPREAD_FOR

    def held_batch(self, task: str) -> None:
        """A straggler of ``task`` could not be let go (it had written into
        its batch's transaction): its jobs run alone for a while."""
        self._isolated[task] = time.monotonic() + ISOLATE_FOR

    # --- learning -----------------------------------------------------------------

    def ran(self, task: str, seconds: float, *, batched: bool) -> None:
        """One handler of ``task`` took ``seconds`` (the handler alone, not
        its transaction's statements)."""
        before = self.task_pace.get(task)
        if before is not None and seconds > self.straggler_after(task):
            return  # a straggler says nothing about the task's usual time
        self.task_pace[task] = seconds if before is None else (
            (1 - _WEIGHT) * before + _WEIGHT * seconds)
        if batched:
            self.pace = seconds if self.pace is None else (
                (1 - _WEIGHT) * self.pace + _WEIGHT * seconds)

    # --- how much work, how it is cut ---------------------------------------------------

    def extra_per_thread(self) -> int:
        """Jobs to have in hand per free thread beyond the one it runs: as
        many as it runs within the batch budget at the batched handlers'
        pace, at least one and at most a group (a worker starts cautious,
        one extra, until it has seen batched handlers)."""
        if self.group <= 1:
            return 0
        if self.pace is None:
            return 1
        return max(1, min(self.group, int(self.budget / max(self.pace, 1e-9))))

    def batches_at_once(self, free: int) -> int:
        """Lane batches to run at once.  Handlers short enough for a full
        batch within the budget: two — one runs while the next fills — so
        deliveries gather into large batches instead of each taking a
        thread and a transaction of its own.  Slower ones, or just after a
        straggler (what waits may be as slow): every free thread.  A batch
        whose handler is a straggler does not count (consumers/runner.py)."""
        if (self.pace is None or self.pace * self.group <= self.budget) and (
                not self.straggling()):
            return min(2, free) if free else 0
        return free

    def batch_size(self, waiting: int, threads: int) -> int:
        """How many of ``waiting`` jobs one batch takes when ``threads``
        may take batches now: spread over them, at most a group."""
        return max(1, min(self.group, math.ceil(waiting / max(1, threads))))
