"""The workloads, run against one system in fresh resources.

A (throughput): enqueue N no-op jobs due now with the worker stopped (timed
in the enqueuing process), then start one worker process and time the jobs'
starts: processing rate = (N - 1) / (last start - first start).  The worker's
own start-up is excluded there and reported separately (spawn to last start).

B (lateness): start the worker, wait until a warm-up job has run, then
enqueue N jobs due at distinct times spread over ``spread`` seconds from
``lead`` seconds after the enqueue began; lateness = start - due.

C (mixed durations, issue #32): as B, but every ``slow_every``-th job of the
one task sleeps ``slow`` s in its handler (after recording its start), and
the worker was warmed up with ``warmup`` jobs; its burst form adds ``burst``
jobs sleeping ``burst_sleep`` s, all due at ``burst_at`` s into the spread,
among the fast ones.  A slow handler that holds a fast job back shows as the
fast jobs' lateness; the slow jobs' own is reported apart.  CPU is metered
from just before the enqueue to the last start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import record
from cpu import CpuMeter
from peer_cli import Job, spread_jobs
from resources import environment
from systems import System

HERE = Path(__file__).resolve().parent


class WorkloadError(RuntimeError):
    """A system did not complete a workload (crash, timeout)."""


@dataclass
class Context:
    kafka: str | None
    sqs: str | None
    logs: Path
    profile_dir: Path | None = None   # py-spy record each worker process into it


@dataclass(frozen=True)
class Mixed:
    """Workload C's shape (issue #32's): one job in 50 sleeps 1 s; the burst
    form adds 8 jobs of 1.5 s due together 1 s into the spread, fewer than
    duebox's or Dramatiq's threads (2 processes x 8 here), so a worker with
    a free thread has no reason to start a fast job late."""

    n: int = 1000
    slow_every: int = 50
    slow: float = 1.0
    burst: int = 0
    burst_sleep: float = 1.5
    burst_at: float = 1.0
    warmup: int = 20  # as issue #32 measured: both worker processes have run jobs

    def enqueue_args(self, lead: float, spread: float) -> list[str]:
        return ["--n", str(self.n), "--lead", str(lead), "--spread", str(spread),
                "--slow-every", str(self.slow_every), "--slow", str(self.slow),
                "--burst", str(self.burst), "--burst-sleep", str(self.burst_sleep),
                "--burst-at", str(self.burst_at)]

    def with_burst(self, burst: int = 8) -> Mixed:
        return replace(self, burst=burst)

    def jobs(self, first_due: float, spread: float) -> list[Job]:
        """The jobs the enqueuer made of this shape (its ``first_due``)."""
        return spread_jobs(first_due, self.n, spread, self.slow_every, self.slow,
                           self.burst, self.burst_sleep, self.burst_at)

    def expected(self, first_due: float, spread: float) -> Counter[record.Key]:
        """Each job's record key: how many jobs share it (the burst's do)."""
        return Counter(record.key(record.tag_for(j.sleep), j.due)
                       for j in self.jobs(first_due, spread))


def _command(system: System, process: str) -> list[str]:
    if system.is_duebox:
        return [sys.executable, "-m", "duebox.cli", "--log-level", "WARNING", process,
                "--app", "peer_duebox:app"]
    return [sys.executable, str(HERE / f"peer_{system.module}.py"), process]


class Processes:
    """A system's long-running processes, each in its own session, so
    stopping one stops its children (Celery's pool) and nothing else."""

    def __init__(self, system: System, env: dict[str, str], ctx: Context, label: str) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.logs: list[Path] = []
        self.spies: list[subprocess.Popen[bytes]] = []
        for process in system.processes:
            self.logs.append(ctx.logs / f"{label}-{process}.log")
            log = open(self.logs[-1], "ab")  # noqa: SIM115
            p = subprocess.Popen(_command(system, process), cwd=HERE, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            self.procs.append((process, p))
            if ctx.profile_dir is not None:
                out = ctx.profile_dir / f"{label}-{process}.txt"
                self.spies.append(subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(p.pid),
                     "--rate", "200", "--format", "raw", "--subprocesses", "-o", str(out)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def check(self, killed: Collection[int] = ()) -> None:
        """Raise if a process exited, but for those ``killed`` on purpose (pids)."""
        for (name, p), log in zip(self.procs, self.logs, strict=True):
            if p.pid not in killed and p.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                raise WorkloadError(f"{name} exited with {p.returncode}: {' | '.join(tail)}")

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for spy in self.spies:  # py-spy writes its file when its target exits
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


def _run(system: System, env: dict[str, str], *args: str) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / f"peer_{system.module}.py"), *args]
    done = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise WorkloadError(f"{' '.join(args)} failed: {done.stderr[-1500:]}")
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _wait(directory: str, n: int, procs: Processes, timeout: float) -> None:
    _until(lambda: max(0, n - record.count(directory)), n, procs, timeout)


def _until(left: Callable[[], int], n: int, procs: Processes, timeout: float) -> None:
    """Wait until ``left()`` (jobs not started) is 0."""
    deadline = time.monotonic() + timeout
    while todo := left():
        procs.check()
        if time.monotonic() > deadline:
            raise WorkloadError(f"{n - todo} of {n} jobs ran in {timeout:.0f} s")
        time.sleep(0.05)  # polling files: no event to wait on across processes


def _env(system: System, base: dict[str, str], aggressive: bool) -> dict[str, str]:
    env = {**os.environ, **base, "PYTHONPATH": str(HERE), "BENCH_AGGRESSIVE": "0",
           **dict(system.env)}
    if aggressive:
        env["BENCH_AGGRESSIVE"] = "1"
        if system.is_duebox:
            env["DUEBOX_POLL_INTERVAL"] = "0.05"
            if system.broker == "kafka":
                env["DUEBOX_BROKER_URL"] += "&fetch_max_wait_ms=5"
    return env


def throughput(system: System, ctx: Context, n: int, label: str) -> dict[str, object]:
    rec = tempfile.mkdtemp(prefix="bench-peers-rec-")
    try:
        with environment(system, ctx.kafka, ctx.sqs, rec) as base:
            env = _env(system, base, aggressive=False)
            _run(system, env, "setup")
            enq = _run(system, env, "enqueue", "--n", str(n))
            spawned = time.time()
            procs = Processes(system, env, ctx, label)
            meter = CpuMeter(system.broker, env["BENCH_PG_URL"],
                             {name: p.pid for name, p in procs.procs})
            try:
                meter.start()
                _wait(rec, n, procs, timeout=max(300.0, n / 30))
                meter.stop()
            finally:
                procs.stop()
        starts = sorted(s for _, s in record.read(rec))
    finally:
        shutil.rmtree(rec, ignore_errors=True)
    return {"enqueue_rate": n / float(enq["seconds"]),
            "enqueue_how": enq["how"],
            "process_rate": (n - 1) / (starts[-1] - starts[0]),
            "spawn_to_done_s": starts[-1] - spawned, "ran": len(starts),
            "cpu": meter.per_job(n)}


def _spread(system: System, ctx: Context, label: str, enqueue: list[str], *,
            aggressive: bool = False, warmup: int = 1, timeout: float,
            expected: Callable[[dict[str, Any]], Counter[record.Key]] | None = None
            ) -> tuple[list[record.Line], dict[str, Any], CpuMeter]:
    """Start the system, run ``warmup`` jobs due now, then ``enqueue ...``
    (jobs due ahead) and wait for every start: the measured lines (due > 0),
    the enqueuer's JSON, and the CPU from just before the enqueue on.
    ``expected(enqueuer's JSON)``: the jobs by key, to wait until each has
    started (a handler that runs twice adds a line, so a count of lines
    could end the wait before the last job started)."""
    rec = tempfile.mkdtemp(prefix="bench-peers-rec-")
    try:
        with environment(system, ctx.kafka, ctx.sqs, rec) as base:
            env = _env(system, base, aggressive)
            _run(system, env, "setup")
            procs = Processes(system, env, ctx, label)
            try:
                _run(system, env, "enqueue", "--warmup", "--n", str(warmup))
                _wait(rec, warmup, procs, timeout=120)
                meter = CpuMeter(system.broker, env["BENCH_PG_URL"],
                                 {name: p.pid for name, p in procs.procs})
                meter.start()
                enq = _run(system, env, "enqueue", *enqueue)
                if expected is None:
                    _wait(rec, warmup + int(enq["n"]), procs, timeout=timeout)
                else:
                    jobs = expected(enq)
                    _until(lambda: record.missing(rec, jobs), int(enq["n"]), procs, timeout)
                meter.stop()
            finally:
                procs.stop()
        lines = [x for x in record.read_lines(rec) if x.due > 0]
    finally:
        shutil.rmtree(rec, ignore_errors=True)
    return lines, enq, meter


def _late_ms(lines: list[record.Line]) -> list[float]:
    return sorted(round((x.started - x.due) * 1000, 3) for x in lines)


def lateness(system: System, ctx: Context, n: int, aggressive: bool, label: str,
             lead: float = 2.0, spread: float = 10.0) -> dict[str, object]:
    lines, _, _ = _spread(system, ctx, label, ["--n", str(n), "--lead", str(lead),
                                               "--spread", str(spread)],
                          aggressive=aggressive, timeout=lead + spread + 90)
    late = _late_ms(lines)
    return {"late_ms": late, "ran": len(late)}


def mixed(system: System, ctx: Context, shape: Mixed, label: str, lead: float = 2.0,
          spread: float = 10.0) -> dict[str, object]:
    """Workload C: ``late_ms`` of the fast jobs, ``slow_late_ms`` of the
    slow, each job's first start; ``repeats``: starts beyond one per job."""
    lines, enq, meter = _spread(system, ctx, label, shape.enqueue_args(lead, spread),
                                warmup=shape.warmup,
                                timeout=lead + spread + 90 + max(shape.slow, shape.burst_sleep),
                                expected=lambda e: shape.expected(e["first_due"], spread))
    seen = record.starts(lines)
    late: dict[str, list[float]] = {"": [], record.SLOW: []}
    for (tag, due), n in shape.expected(enq["first_due"], spread).items():
        late[tag] += [round((s - float(due)) * 1000, 3) for s in seen[(tag, due)][:n]]
    return {"late_ms": sorted(late[""]), "slow_late_ms": sorted(late[record.SLOW]),
            "ran": len(lines), "repeats": len(lines) - int(enq["n"]), "slow_jobs": enq["slow"],
            "cpu": meter.per_job(int(enq["n"]))}
