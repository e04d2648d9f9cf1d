"""The app that tests/test_worker_processes.py runs under ``duebox worker
--processes N``: ``--app tests.apps.procs_app:app``.

``procs.effect`` sleeps ``payload["seconds"]`` (default 0), waits until the
file ``payload["wait_for"]`` exists (if given), then writes one
row of the tests' ``effects`` table through ``ctx.session`` (primary key: the
job id; the row names the worker). Before anything else, every call appends
``<job id> <pid>`` to the file ``PROCS_CALLS`` names, a write outside any
transaction: the test counts *calls*, committed or not, so a handler run
twice shows even when its second transaction could not commit.

``PROCS_FAIL_IN_CHILD`` makes the import fail in a supervised child only
(``duebox.cli.child`` is the program), the supervisor having imported the app
itself first: ``config`` with a ConfigurationError, ``crash`` with a plain
exception.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import duebox
from duebox import ConfigurationError
from tests.helpers import effect_values, effects

_in_child = sys.argv[0].endswith(os.path.join("cli", "child.py"))
if _in_child and os.environ.get("PROCS_FAIL_IN_CHILD") == "config":
    raise ConfigurationError("procs_app: refused in the child, as the test asked")
if _in_child and os.environ.get("PROCS_FAIL_IN_CHILD") == "crash":
    raise RuntimeError("procs_app: crashed in the child, as the test asked")

app = duebox.Duebox(settings=duebox.Settings(
    lease_seconds=float(os.environ.get("PROCS_LEASE_SECONDS", "300")),
    poll_interval=0.05, clock_skew_margin=0.2, batch_size=20))


@app.task("procs.effect", max_attempts=5)
def effect(payload: Any, ctx: duebox.JobContext) -> None:
    with open(os.environ["PROCS_CALLS"], "a") as calls:
        calls.write(f"{ctx.job_id} {os.getpid()}\n")
    time.sleep(float((payload or {}).get("seconds", 0)))
    _wait_for((payload or {}).get("wait_for"))
    ctx.session.execute(effects.insert().values(effect_values(ctx)))


def _wait_for(path: str | None) -> None:
    """A slow (or hanging) handler that the test releases: until the file
    ``path`` exists, whatever the machine's speed (a file is the event two
    processes share)."""
    deadline = time.monotonic() + 600
    while path is not None and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
