"""``duebox dashboard`` as a real process, for what only a process shows:
its threads, its peak memory, its log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Process:
    url: str
    pid: int
    log_path: Path

    def _status(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {key} in /proc/{self.pid}/status")

    def threads(self) -> int:
        return self._status("Threads")

    def peak_rss_kib(self) -> int:
        return self._status("VmHWM")

    def log(self) -> str:
        return self.log_path.read_text()


@contextmanager
def dashboard_process(database_url: str, tmp: Path, *args: str, token: str | None = None
                      ) -> Iterator[Process]:
    """``duebox dashboard --port 0 ARGS`` on ``database_url``, stopped with
    SIGINT at the end (it must exit 0)."""
    env = {**os.environ, "DUEBOX_DASHBOARD_PORT": "0", "DUEBOX_DATABASE_URL": database_url,
           "DUEBOX_LOG_LEVEL": "INFO"}
    env.pop("DUEBOX_DASHBOARD_TOKEN", None)
    if token is not None:
        env["DUEBOX_DASHBOARD_TOKEN"] = token
    log_path = tmp / f"dashboard-{time.monotonic_ns()}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "duebox.cli", "dashboard", *args], env=env, cwd=tmp,
            stdout=log, stderr=log,
            # As from a terminal (a background test session may ignore SIGINT).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"duebox dashboard on (http://\S+) ", log_path.read_text())):
            assert proc.poll() is None, f"the dashboard exited: {log_path.read_text()}"
            assert time.monotonic() < deadline, f"no dashboard URL: {log_path.read_text()}"
            time.sleep(0.05)
        yield Process(m.group(1), proc.pid, log_path)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
