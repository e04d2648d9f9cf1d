"""One log line per finished job, when asked for: Celery's "Task ...
succeeded in 0.01s", with the attempt, the start's lateness and the outcome.

Off by default (``log_jobs``, ``DUEBOX_LOG_JOBS``, ``duebox worker
--log-jobs``): a worker running thousands of short jobs a second would
otherwise spend a good part of its time writing them (bench/job_lines.py
measures it; docs/observability.md has the figures).  Switched off, a job
costs one attribute read here.  Switched on, the lines go to the logger
``duebox.jobs`` at INFO, so a logging configuration can still route or
drop them by name::

    ... INFO duebox.jobs: job 0190c2d4-... send-reminder attempt 1 succeeded
    in 0.012s, started 0.003s late                            (one line)

With ``--log-format json`` the same line carries ``job_id``, ``task``,
``queue``, ``attempt``, ``outcome``, ``run_s`` and ``late_s`` as fields.
"""

from __future__ import annotations

import logging
from datetime import datetime

from duebox.leases.records import JobRecord
from duebox.observability.logs import job_fields

log = logging.getLogger("duebox.jobs")


class JobLines:
    """Writes the line for each job a worker finished, if ``enabled`` (and
    the ``duebox.jobs`` logger takes INFO when the worker starts)."""

    def __init__(self, enabled: bool) -> None:
        self.asked = enabled
        self.enabled = enabled

    def start(self) -> None:
        """Look at the logger once, when the worker starts: logging is
        configured by then, and a disabled logger costs nothing per job."""
        self.enabled = self.asked and log.isEnabledFor(logging.INFO)

    def write(self, rec: JobRecord, outcome: str, started: datetime,
              finished: datetime) -> None:
        """The line of ``rec``, finished with ``outcome`` (the worker asks
        :attr:`enabled` first, so that a job costs no call when off)."""
        if not self.enabled:
            return
        run_s = round((finished - started).total_seconds(), 6)
        late_s = round((started - rec.due_at).total_seconds(), 6)
        log.info("job %s %s attempt %d %s in %.3fs, started %.3fs late", rec.id, rec.task,
                 rec.attempt, outcome, run_s, late_s,
                 extra={**job_fields(rec), "outcome": outcome, "run_s": run_s,
                        "late_s": late_s})
