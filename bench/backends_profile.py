"""Where the relay's time goes: py-spy on the timed part of a relay trial.

``sampling(path)`` attaches ``py-spy record`` to this very process for the
duration of a ``with`` block (the trial's timed loop only: no loading, no
raw baseline), with ``--idle`` so waiting shows too.  ``summarize(path)``
reads the samples back:

* **wall clock** — the relay awaits one thing at a time (claim, publish,
  mark), so its event-loop thread's samples are the timed window: Python it
  ran (by phase), the database calls it awaited (sampled in the pool threads
  that ran them, waiting on PostgreSQL or running Python), and the rest of
  its idle time, which is awaiting the broker.
* **top functions** — self time of the samples that were not waiting
  (CPU), by function.

    python bench/backends_profile.py FILE.raw     # print the summary of a recording
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

RATE = 250  # samples per second
# A path in this variable makes a relay trial record its timed loop there.
PROFILE_ENV = "DUEBOX_BENCH_PYSPY"

# A leaf frame in one of these means the thread was waiting, not computing.
_WAITS = (
    ("psycopg/connection.py", "wait PostgreSQL"),
    ("psycopg/waiting.py", "wait PostgreSQL"),
    ("selectors.py", "event loop idle (awaiting I/O)"),
    ("threading.py", "thread waiting"),
    ("queue.py", "thread waiting"),
    ("concurrent/futures/thread.py", "thread waiting"),
    ("ssl.py", "wait broker socket"),
    ("socket.py", "wait broker socket"),
)
# The first of these (innermost first) in a stack names the relay's phase.
_PHASES = (
    ("Pipeline.claim", "claim (transaction + rows → JobRecord)"),
    ("mark_enqueued", "mark ENQUEUED"),
    ("LeaseRecovery.", "lease recovery"),
    ("next_due", "next-due query"),
    (".publish (brokers/", "broker publish"),
    ("(brokers/", "broker publish"),
    ("Pipeline._send", "build messages, metrics"),
    ("Pipeline._sort", "dispatch bookkeeping, metrics"),
)
_DB_PHASES = ("claim (transaction + rows → JobRecord)", "mark ENQUEUED", "lease recovery",
              "next-due query")


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if os.access(found, os.X_OK) else None


@contextlib.contextmanager
def sampling(path: str | None) -> Iterator[None]:
    """Record this process with py-spy while the block runs (no-op without a path)."""
    exe = py_spy() if path else None
    if not path:
        yield
        return
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    spy = subprocess.Popen(
        [exe, "record", "--pid", str(os.getpid()), "--idle", "--threads", "-r", str(RATE),
         "--format", "raw", "-o", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    assert spy.stdout is not None
    first = spy.stdout.readline()  # "py-spy> Sampling process ..." once it is attached
    if "Sampling" not in first:
        spy.kill()
        raise RuntimeError(f"py-spy did not start: {first}{spy.stdout.read()}")
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes the file on Ctrl-C
        tail = spy.communicate(timeout=60)[0]
        if spy.returncode not in (0, -signal.SIGINT) and not Path(path).exists():
            raise RuntimeError(f"py-spy failed ({spy.returncode}): {tail}")


def _function(frame: str) -> str:
    """``name (path/to/file.py:123)`` → ``name (file.py)``; line numbers split
    one function into many rows otherwise."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0]
    parts = file.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else file
    return f"{name} ({short})"


def _waiting(leaf: str) -> str | None:
    return next((label for needle, label in _WAITS if needle in leaf), None)


def _phase(frames: list[str]) -> str | None:
    for frame in reversed(frames):
        found = next((label for needle, label in _PHASES if needle in frame), None)
        if found:
            return found
    return None


def summarize(path: str, top: int = 12) -> dict[str, object]:
    """Wall clock of the relay's event-loop thread, split into what it ran,
    the database calls it awaited (sampled in the pool threads running them)
    and the rest of its idle time (awaiting the broker); and the top functions
    by self time among all samples not waiting (CPU, every thread)."""
    stacks: list[tuple[str, list[str], int]] = []
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if count.isdigit() and len(frames) > 1:
            stacks.append((frames[0], frames[1:], int(count)))
    main = next((t for t, frames, _ in stacks if any("<module>" in f for f in frames)), None)
    loop: Counter[str] = Counter()
    db: Counter[str] = Counter()
    own: Counter[str] = Counter()
    idle = busy = 0
    for thread, frames, n in stacks:
        waiting = _waiting(frames[-1])
        phase = _phase(frames)
        if thread == main:
            if waiting:
                idle += n
            else:
                loop[phase or "event loop, asyncio, other"] += n
        elif phase in _DB_PHASES:
            db[f"{phase}: {'waiting for PostgreSQL' if waiting else 'Python'}"] += n
        if not waiting:
            busy += n
            own[_function(frames[-1])] += n
    wall = idle + sum(loop.values())
    rows = Counter({f"{k} (event loop)": v for k, v in loop.items()})
    rows.update(db)
    rows["awaiting the broker (acks, network), other idle"] = max(0, idle - sum(db.values()))
    return {
        "samples": wall, "busy_samples": busy, "rate": RATE,
        "phases": [(k, v / max(1, wall)) for k, v in rows.most_common() if v],
        "top": [(k, v / max(1, busy)) for k, v in own.most_common(top)],
    }


def markdown(summary: dict[str, object]) -> list[str]:
    phases = summary["phases"]
    tops = summary["top"]
    assert isinstance(phases, list)
    assert isinstance(tops, list)
    out = [f"{summary['samples']:,} samples of the relay's event-loop thread at "
           f"{summary['rate']} Hz; {summary['busy_samples']:,} samples (all threads) not "
           "waiting.", "", "| where the wall-clock time went | share |", "| --- | ---: |"]
    out += [f"| {k} | {v:.0%} |" for k, v in phases]
    out += ["", "| function (self time, samples not waiting) | share |", "| --- | ---: |"]
    out += [f"| `{k}` | {v:.1%} |" for k, v in tops]
    return out


if __name__ == "__main__":
    print("\n".join(markdown(summarize(sys.argv[1]))))
