"""Relay processes for the scale tests (tests/procs/scale_relay.py): the
process handling of tests/test_processes.py, plus pause/resume and the
relay's final JSON totals read back from its log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_processes import Procs, poll

__all__ = ["RelayProcs", "_relay_procs", "poll"]

LAUNCHER = Path(__file__).parent / "procs" / "scale_relay.py"


class RelayProcs(Procs):
    def start_relay(self, url: str, broker: str, name: str, *shards: object,
                    env: dict[str, str] | None = None) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(LAUNCHER), url, broker, name, *map(str, shards)],
            stdout=log, stderr=subprocess.STDOUT, cwd=LAUNCHER.parents[2],
            env={**os.environ, **(env or {})},
        )
        log.close()

    def signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} had already exited:\n{self.log(name)}"
        os.kill(proc.pid, sig)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop(self, name: str) -> dict[str, Any]:
        """SIGTERM (after SIGCONT, in case it is paused); its totals."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{self.log(name)}"
        lines = [ln for ln in self.log(name).splitlines() if ln.startswith("{")]
        assert lines, f"{name} printed no totals:\n{self.log(name)}"
        totals: dict[str, Any] = json.loads(lines[-1])
        return totals


@pytest.fixture(name="relay_procs")
def _relay_procs(tmp_path: Path) -> Iterator[RelayProcs]:
    """Relay processes of this test, all stopped (resumed first) at the end."""
    procs = RelayProcs(tmp_path, LAUNCHER)
    try:
        yield procs
    finally:
        procs.stop_all()
