"""Running trials, and one broker backend's benchmark from start to section.

``run.py`` calls :func:`run_backend` for each of redis, amqp, sqs, kafka: it
brings up the backend's service (``backends_services``), runs the relay and
lateness trials (``backends_trials``), each in a fresh process and in a
namespace of its own, optionally a py-spy profile of the relay, and returns
the backend's RESULTS.md section (``backends_report``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import backends_profile
import backends_report
import backends_services
from backends_report import Measurement

HERE = Path(__file__).resolve().parent
BACKEND_TRIALS = HERE / "backends_trials.py"


@dataclass
class BrokerPlan:
    relay_n: dict[str, int]
    rate: float
    seconds: float
    repeats: int


BROKER_FULL = BrokerPlan(relay_n={"redis": 50_000, "amqp": 100_000, "sqs": 5_000,
                                  "kafka": 50_000}, rate=100.0, seconds=10.0, repeats=3)
BROKER_QUICK = BrokerPlan(relay_n={"redis": 5_000, "amqp": 10_000, "sqs": 1_000,
                                   "kafka": 5_000}, rate=100.0, seconds=3.0, repeats=1)


def run_trial(script: Path, args: list[str], timeout: float,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """``python SCRIPT ARGS`` in a fresh process; its last stdout line is JSON.

    The trial runs in a process group of its own: on a timeout or an interrupt
    the whole group goes (its worker and producer processes, py-spy), not
    only the trial."""
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        _stop_group(proc)
        raise
    if proc.returncode != 0:
        tail = "\n".join((stderr or stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{shlex.join(args[:2])} failed ({proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def _stop_group(proc: subprocess.Popen[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.communicate(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of all CPUs busy (any process) over ``seconds``: background noise."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
        return sum(parts), parts[3] + parts[4]

    try:
        t1, i1 = sample()
        time.sleep(seconds)
        t2, i2 = sample()
    except OSError:
        return float("nan")
    return 1.0 - (i2 - i1) / max(1, t2 - t1)


def wait_quiet(limit: float, threshold: float = 0.35) -> float:
    """On a shared machine: wait up to ``limit`` seconds for other processes to
    leave the CPUs mostly idle; returns the last busy share seen."""
    deadline = time.monotonic() + limit
    busy = cpu_busy(0.5)
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    return busy


def _trial(m: Measurement, args: list[str], quiet: float, timeout: float,
           env: dict[str, str] | None = None) -> dict[str, Any] | None:
    busy = wait_quiet(quiet) if quiet > 0 else cpu_busy(0.5)
    started = time.monotonic()
    try:
        result = run_trial(BACKEND_TRIALS, args, timeout, env)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        m.error = str(exc)
        print(f"  {m.name} [{m.db}]: FAILED\n{exc}", flush=True)
        return None
    result["background_cpu"] = busy
    result["wall"] = time.monotonic() - started
    return result


def _say(m: Measurement, i: int, repeats: int, r: dict[str, Any]) -> None:
    if "relay" in r and "raw" in r:
        text = (f"relay {r['relay']['rate']:,.0f} jobs/s, raw {r['raw']['rate']:,.0f} msg/s, "
                f"ratio {r['ratio']:.2f}")
    elif "relay" in r:
        text = f"relay {r['relay']['rate']:,.0f} jobs/s"
    else:
        text = (f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms, "
                f"early {r['early']}")
    print(f"  {m.name} [{m.db}] trial {i + 1}/{repeats}: {text} ({r['wall']:.0f}s, CPU busy "
          f"before, all processes: {r['background_cpu']:.0%})", flush=True)


def run_backend(backend: str, db_url: str, plan: BrokerPlan, machine: list[tuple[str, str]],
                command: str, quiet: float = 0.0, profile: bool = False) -> str:
    """Measure ``backend`` and return its RESULTS.md section."""
    started = time.monotonic()
    load_start = os.getloadavg()
    n = plan.relay_n[backend]
    relay, late = Measurement("relay", backend), Measurement("lateness", backend)
    extra: dict[str, Any] = {}
    print(f"{backend}:", flush=True)
    try:
        with backends_services.service(backend) as address:
            for i in range(plan.repeats):
                with backends_services.namespace(backend, address) as url:
                    r = _trial(relay, ["relay", backend, db_url, url, str(n),
                                       *(["--raw-first"] if i % 2 else [])], quiet, 600)
                    if r is None:
                        break
                    relay.trials.append(r)
                    _say(relay, i, plan.repeats, r)
                    if backend == "amqp" and "topology" not in extra:
                        extra["topology"] = topology(url, n)
            for i in range(plan.repeats):
                with backends_services.namespace(backend, address) as url:
                    r = _trial(late, ["lateness", backend, db_url, url, str(plan.rate),
                                      str(plan.seconds)], quiet, plan.seconds + 300)
                    if r is None:
                        break
                    late.trials.append(r)
                    _say(late, i, plan.repeats, r)
            if profile:
                extra["profile"] = profile_relay(backend, db_url, address, n, quiet)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        relay.error = relay.error or f"{backend} service: {exc}"
        print(f"  {backend}: FAILED: {exc}", flush=True)
    header = [f"Generated by `{command}` in {(time.monotonic() - started) / 60:.1f} min; "
              f"{plan.repeats} trial(s) per measurement, each in a fresh process; figures are "
              "the median with the range (min–max) in brackets.  The machine is shared: "
              "load average at start "
              f"{' / '.join(f'{x:.2f}' for x in load_start)}, at the end "
              f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min).", "",
              *backends_report.machine_table(machine + backends_report.backend_versions(backend))]
    return backends_report.backend_section(backend, relay, late, extra, header)


def topology(url: str, published: int) -> dict[str, Any]:
    rows = backends_services.amqp_queues(url)
    tiers = [r for r in rows if ".delay." in r[0]]
    return {"published": published, "queues": len(rows),
            "messages": sum(r[1] for r in rows), "memory": sum(r[2] for r in rows),
            "tiers": len(tiers), "tier_messages": sum(r[1] for r in tiers),
            "tier_memory": sum(r[2] for r in tiers),
            "tier_max_memory": max((r[2] for r in tiers), default=0),
            "largest": sorted(rows, key=lambda r: -r[2])[:5]}


def profile_relay(backend: str, db_url: str, address: str, n: int,
                  quiet: float) -> dict[str, Any] | None:
    """One more relay trial (the relay alone) with py-spy on its timed loop."""
    m = Measurement("profile", backend)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"duebox-bench-{backend}-{os.getpid()}.raw"
    with backends_services.namespace(backend, address) as url:
        r = _trial(m, ["relay", backend, db_url, url, str(n)], quiet, 600,
                   env={backends_profile.PROFILE_ENV: str(out)})
    if r is None:
        return None
    try:
        summary = backends_profile.summarize(str(out))
    finally:
        out.unlink(missing_ok=True)
    print(f"  profile [{backend}]: {summary['samples']} samples", flush=True)
    return {"n": n, "rate": r["relay"]["rate"], "summary": summary}
