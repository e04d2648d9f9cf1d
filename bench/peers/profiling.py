"""py-spy's raw (collapsed-stack) output, summarised.

Every sample of every thread is one stack.  Samples whose top frame is a
known wait (an idle pool thread, the event loop in epoll, psycopg waiting
for the server, a lock) are counted per kind of wait; of the rest (the
threads doing work) the functions with the most samples are listed: self
(on top of the stack) over all code, inclusive (anywhere on the stack) over
duebox's own functions only (not the CLI wrappers), so the list names
duebox's hot paths rather than ``Thread.run``.  Waits are percentages of all
samples of the process (every thread, so an idle pool weighs a lot); the
function lists are percentages of its working samples.  Stacks inside an
import are start-up, counted apart.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
WAITS = {
    "_worker (concurrent/futures/thread.py)": "idle thread-pool thread",
    "EpollSelector.select (selectors.py)": "event loop waiting (epoll)",
    "Connection.wait (psycopg/connection.py)": "waiting for PostgreSQL (psycopg, sync)",
    "AsyncConnection.wait (psycopg/connection_async.py)": "waiting for PostgreSQL (psycopg, async)",
    "Condition.wait (threading.py)": "lock / condition wait",
    "Event.wait (threading.py)": "lock / condition wait",
    "Thread.join (threading.py)": "lock / condition wait",
}
DUEBOX = ("core/", "relay/", "consumers/", "brokers/", "cli/")


def _name(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m["file"]
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{m['fn']} ({path})"


def _is_duebox(name: str) -> bool:
    return name.rsplit("(", 1)[-1].startswith(DUEBOX)


def summarise(path: Path, top: int = 15) -> dict[str, Any]:
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    waits: Counter[str] = Counter()
    total = 0
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_name(f) for f in stack.split(";")]
        frames = [f for f in frames if not f.startswith("process ")]  # --subprocesses root
        if not frames:
            continue
        total += n
        if any(f.startswith("_find_and_load (") for f in frames):
            waits["start-up: imports"] += n
            continue
        if frames[-1] in WAITS:
            waits[WAITS[frames[-1]]] += n
            continue
        own[frames[-1]] += n
        for f in dict.fromkeys(frames):  # each once, in a stable order (ties)
            if _is_duebox(f) and not f.startswith("<module>") and "(cli/" not in f:
                inclusive[f] += n

    def share(c: Counter[str], of: int) -> list[tuple[str, float]]:
        return [(f, round(100 * k / of, 1)) for f, k in c.most_common(top)] if of else []

    busy = total - sum(waits.values())
    return {"samples": total, "busy": busy, "waits": share(waits, total),
            "inclusive": share(inclusive, busy), "self": share(own, busy)}
