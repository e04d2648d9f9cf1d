"""Side-by-side benchmark of duebox and its peers (issue #8): one command.

    python bench/peers/run.py            # 3 runs, workloads A, B, C, C-burst
    python bench/peers/run.py --quick    # 2,000 + 100 jobs (C: 100), 1 run: checks the harness
    python bench/peers/run.py --only celery-redis,duebox-sql --runs 1
    python bench/peers/run.py --workloads C,C-burst --only duebox-sql --runs 1
    python bench/peers/run.py --sqs      # also duebox on LocalStack's SQS
    python bench/peers/run.py --report-only   # re-render RESULTS.md from results.json

The peers are installed into a bench-only virtual environment
($HOME/.cache/duebox/bench-peers-venv, or BENCH_PEERS_VENV), never into the
project's dependencies: this script creates it from requirements.txt plus
``-e <repo>[postgres,redis,rabbitmq,kafka,sqs]``, then runs itself inside it.
It writes results.json (every measurement) and RESULTS.md beside itself.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKLOADS = ("A", "B", "C", "C-burst")  # what --workloads may name (harness.run_one)
VENV = Path(os.environ.get("BENCH_PEERS_VENV",
                           Path.home() / ".cache" / "duebox" / "bench-peers-venv"))


def ensure_venv() -> Path:
    """The bench venv's python, (re)installed when requirements.txt changed."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".requirements.sha256"
    want = hashlib.sha256((HERE / "requirements.txt").read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return python
    if not python.exists():
        print(f"creating the bench venv {VENV}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r",
                    str(HERE / "requirements.txt"),
                    "-e", f"{ROOT}[postgres,redis,rabbitmq,kafka,sqs]"], check=True)
    stamp.write_text(want)
    return python


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--jobs", type=int, default=20_000, help="workload A jobs")
    p.add_argument("--late-jobs", type=int, default=1000,
                   help="workload B jobs (over --spread: 100 jobs/s)")
    p.add_argument("--fast-late-jobs", type=int, default=5000,
                   help="workload B at speed, default settings (500 jobs/s); 0: skip")
    p.add_argument("--spread", type=float, default=10.0, help="workloads B and C: seconds")
    p.add_argument("--mixed-jobs", type=int, default=1000,
                   help="workload C jobs (over --spread), one in 50 slow; C-burst: 8 more")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (B: with its fast and "
                        "aggressive forms)")
    p.add_argument("--only", default=None, help="comma-separated system names")
    p.add_argument("--quick", action="store_true", help="2,000 + 100 jobs (C: 100), 1 run")
    p.add_argument("--sqs", action="store_true", help="also duebox-sqs (LocalStack)")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy pass")
    p.add_argument("--profile-only", action="store_true", help="only the py-spy pass")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--note", default=None, help="a paragraph for the top of RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.jobs, args.late_jobs, args.fast_late_jobs = 1, 2000, 100, 200
        args.mixed_jobs = 100
    for name in ("runs", "jobs", "late_jobs", "mixed_jobs"):
        if getattr(args, name) < 1 or (name != "runs" and getattr(args, name) < 2):
            p.error(f"--{name.replace('_', '-')}: too small")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        p.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; "
                f"known: {', '.join(WORKLOADS)}")
    return args


def main() -> None:
    args = parse(sys.argv[1:])
    if Path(sys.prefix).resolve() != VENV.resolve():
        python = ensure_venv()
        os.execv(str(python), [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])
    sys.path.insert(0, str(HERE))
    from harness import run_all

    run_all(args, argv=sys.argv[1:])


if __name__ == "__main__":
    main()
