"""duebox.cli.metrics_dir: a supervisor's metrics directory is its own,
new for every run; one left by a supervisor that died (its lock free) is
removed by the next, one whose supervisor lives (its lock held) never is,
and a directory that is not a supervisor's is left alone."""

from __future__ import annotations

import os
from pathlib import Path

from duebox.cli.metrics_dir import LOCK, PREFIX, MetricsDir, sweep


def test_each_run_has_a_directory_of_its_own_named_for_its_children(tmp_path: Path) -> None:
    first, second = MetricsDir(tmp_path), MetricsDir(tmp_path)
    try:
        assert first.path != second.path
        assert first.path.parent == tmp_path
        assert first.path.name.startswith(PREFIX)
        assert first.env == {"PROMETHEUS_MULTIPROC_DIR": str(first.path)}
        assert (first.path / LOCK).exists()
    finally:
        first.remove()
        second.remove()
    assert not first.path.exists()


def test_a_dead_supervisors_directory_goes_a_live_ones_stays(tmp_path: Path) -> None:
    live = MetricsDir(tmp_path)
    dead = MetricsDir(tmp_path)
    assert dead._fd is not None
    os.close(dead._fd)  # what the kernel does when a supervisor is SIGKILLed
    dead._fd = None
    (tmp_path / f"{PREFIX}not-a-supervisors").mkdir()  # no lock file: not ours
    half = tmp_path / f"{PREFIX}half-made"
    half.mkdir()
    (half / (LOCK + ".new")).touch()
    try:
        assert sweep(tmp_path) == [dead.path]
        assert live.path.exists()
        assert not dead.path.exists()
        assert (tmp_path / f"{PREFIX}not-a-supervisors").exists()
        assert half.exists()
        again = MetricsDir(tmp_path)  # a new supervisor sweeps at start, too
        assert live.path.exists()
        again.remove()
    finally:
        live.remove()
