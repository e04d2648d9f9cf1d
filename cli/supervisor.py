"""The supervisor behind ``duebox worker --processes N``: N worker processes
that are restarted when they die, stopped together, and never outlive it.

Each child is a whole one-process worker (cli/child.py): its own name, made
afresh at every start (a restarted child under its predecessor's name would
take the free liveness lock and hide the dead one's jobs until their leases
expire), its own liveness lock and registry row, its own connections.
Nothing is shared but the metrics directory (cli/metrics_dir.py).

One thread, one loop, no timers but the next restart: signals (SIGCHLD,
SIGINT, SIGTERM) arrive as bytes on a socket (``signal.set_wakeup_fd``) and
the loop acts on them, never a signal handler.

* **A child that exits** while the supervisor is not stopping is started
  again after a backoff: 0.5 s after one that ran at least
  ``STARTUP_SECONDS``, doubling for each exit in a row sooner than that.
  ``GIVE_UP`` such quick exits in a row stop the supervisor with an error
  (an app that cannot start in a fresh process, a database it cannot
  reach), and so does one configuration error (exit status 78), at once.
* **SIGTERM or SIGINT** stops: each child gets SIGTERM and drains as one
  worker does (finishes the handlers it started, gives back the jobs it had
  taken but not started); the supervisor waits for all of them, as long as
  their handlers take, then exits 0.
* **A second SIGTERM or SIGINT** while they drain kills them (SIGKILL) and
  exits 1: their running handlers stop where they are and their jobs go
  back to ``SCHEDULED`` as soon as a relay sees their liveness locks free,
  as after any crash. A stop that must end by a deadline is a second signal
  at that deadline — which is what systemd's ``TimeoutStopSec`` and
  Kubernetes' grace period do with SIGKILL, and the children die with the
  supervisor then too.

Children are started from this (the main) thread only: the kernel's
parent-death signal follows the *thread* that forked the child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import click
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from duebox.errors import ConfigurationError

from .metrics_dir import MetricsDir
from .options import EX_CONFIG  # a child's exit status for an error it would meet again

log = logging.getLogger("duebox.supervisor")


STARTUP_SECONDS = 30.0  # a child that exits sooner failed to start (imports are slow under load)
GIVE_UP = 5  # quick exits in a row, in one slot, that stop the supervisor
RESTART_DELAY = 0.5  # before starting a child again; doubles per quick exit
MAX_RESTART_DELAY = 30.0


@dataclass
class Child:
    """One of the N slots and the process in it, if any."""

    slot: int
    proc: subprocess.Popen[bytes] | None = None
    status: int | None = None  # read end of its status pipe
    started: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None


def describe(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


@contextlib.contextmanager
def _wakeups() -> Iterator[socket.socket]:
    """A socket that receives one byte, the signal's number, per SIGCHLD,
    SIGINT and SIGTERM; the previous handlers are back afterwards."""
    receive, send = socket.socketpair()
    receive.setblocking(False)
    send.setblocking(False)
    previous_fd = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, lambda *_: None)
                for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM)}
    try:
        yield receive
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        receive.close()
        send.close()


def _received(wake: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := wake.recv(4096):
            data += chunk
    return data


def _read_status(fd: int) -> str:
    """What a child that exited wrote to its status pipe (closed here)."""
    data = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 4096):
            data += chunk
    os.close(fd)
    return data.decode("utf-8", "replace").strip()


class Supervisor:
    """Runs ``python -m duebox.cli.child <pid> <fd> *args`` ``count`` times."""

    def __init__(self, count: int, args: list[str], env: dict[str, str],
                 metrics: MetricsDir | None = None) -> None:
        self.children = [Child(slot) for slot in range(1, count + 1)]
        self.args = args
        self.env = env
        self.metrics = metrics
        self.stopping = False
        self.killed = 0
        self.restarts = 0
        self.failure: str | None = None
        self.configuration_failure = False

    def run(self) -> None:
        """Until stopped; raises what stopped it, if not a signal."""
        with _wakeups() as wake:
            try:
                for child in self.children:
                    self._start(child)
                pids = [str(c.proc.pid) for c in self.children if c.proc is not None]
                log.info("supervisor (pid %d) started %d worker processes: pids %s",
                         os.getpid(), len(pids), ", ".join(pids))
                while self.running() or not self.stopping:
                    select.select([wake], [], [], self._next_start_in())
                    for signum in _received(wake):
                        if signum in (signal.SIGINT, signal.SIGTERM):
                            self._signalled(signal.Signals(signum))
                    self._reap()
                    self._start_due()
            finally:
                self._abandon()
        log.info("supervisor (pid %d) stopped", os.getpid())
        if self.failure is not None:
            if self.configuration_failure:
                raise ConfigurationError(self.failure)
            raise click.ClickException(self.failure)
        if self.killed:
            raise click.ClickException(
                f"killed {self.killed} worker processes before their handlers finished "
                "(a second stop signal); their jobs go back to SCHEDULED when a relay sees "
                "them gone")

    # --- children ---------------------------------------------------------------

    def _start(self, child: Child) -> None:
        child.started = time.monotonic()
        child.restart_at = None
        try:
            read, write = os.pipe()
        except OSError as exc:  # out of file descriptors
            self._again(child, f"worker process {child.slot} could not be started ({exc})")
            return
        try:
            child.proc = subprocess.Popen(
                [sys.executable, "-m", "duebox.cli.child", str(os.getpid()), str(write),
                 *self.args], env=self.env, stdin=subprocess.DEVNULL, pass_fds=(write,))
        except OSError as exc:  # no memory, no processes left, no executable
            os.close(read)
            self._again(child, f"worker process {child.slot} could not be started ({exc})")
            return
        finally:
            os.close(write)
        os.set_blocking(read, False)
        child.status = read

    def running(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None]

    def _next_start_in(self) -> float | None:
        due = [c.restart_at for c in self.children if c.restart_at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _start_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None and child.restart_at <= now and not self.stopping:
                self._start(child)
                self.restarts += 1
                if child.proc is not None:
                    log.info("worker process %d started again: pid %d", child.slot,
                             child.proc.pid)

    def _reap(self) -> None:
        for child in self.running():
            assert child.proc is not None
            returncode = child.proc.poll()
            if returncode is not None:
                self._exited(child, child.proc.pid, returncode)

    def _exited(self, child: Child, pid: int, returncode: int) -> None:
        child.proc = None
        message = _read_status(child.status) if child.status is not None else ""
        child.status = None
        if self.metrics is not None:
            self.metrics.mark_dead(pid)
        what = f"worker process {child.slot} (pid {pid}) {describe(returncode)}"
        if self.stopping:
            # Stopped by the SIGTERM it was sent (or the terminal's Ctrl-C)
            # before it had set up its own handling: it had taken no job yet.
            stopped = returncode in (0, 130, -signal.SIGTERM, -signal.SIGINT)
            if not stopped and not self.killed and self.failure is None:
                self.failure = f"{what} while stopping"
            return
        if returncode == EX_CONFIG:
            self._fail(f"{what}: {message or 'a configuration error'}", configuration=True)
            return
        self._again(child, what)

    def _again(self, child: Child, what: str) -> None:
        """Start the slot again after its backoff, or give up."""
        lived = time.monotonic() - child.started
        child.quick_exits = child.quick_exits + 1 if lived < STARTUP_SECONDS else 0
        if child.quick_exits >= GIVE_UP:
            self._fail(f"{what}, the {GIVE_UP}th time in a row within {STARTUP_SECONDS:g} s "
                       "of its start (its output is above)")
            return
        delay = min(MAX_RESTART_DELAY, RESTART_DELAY * 2 ** child.quick_exits)
        child.restart_at = time.monotonic() + delay
        log.warning("%s after %.1f s; starting another in %.1f s", what, lived, delay)

    # --- stopping ---------------------------------------------------------------

    def _signalled(self, sig: signal.Signals) -> None:
        if not self.stopping:
            self._stop(f"{sig.name}; {sig.name} again kills them")
        else:
            self._kill()

    def _fail(self, message: str, *, configuration: bool = False) -> None:
        log.error("%s; stopping", message)
        self.failure = message
        self.configuration_failure = configuration
        self._stop("an error; SIGTERM kills them")

    def _stop(self, why: str) -> None:
        self.stopping = True
        for child in self.children:
            child.restart_at = None
        running = self.running()
        log.info("stopping (%s): %d worker processes finish the handlers they started and "
                 "give back the jobs they had not", why, len(running))
        for child in running:
            assert child.proc is not None
            child.proc.send_signal(signal.SIGTERM)

    def _kill(self) -> None:
        running = self.running()
        log.warning("killing %d worker processes (SIGKILL): their running handlers stop "
                    "now and their jobs go back to SCHEDULED", len(running))
        for child in running:
            assert child.proc is not None
            child.proc.kill()
        self.killed += len(running)

    def _abandon(self) -> None:
        """Whatever ended the loop, no child is left behind (the loop ends
        with none running; an error in it would leave some)."""
        self.stopping = True
        for child in self.running():
            assert child.proc is not None
            child.proc.kill()
            child.proc.wait()
            self._exited(child, child.proc.pid, child.proc.returncode)


class SupervisorCollector(Collector):
    """The supervisor's own numbers, beside the children's sums."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("duebox_worker_processes",
                                "Worker processes running under this supervisor.",
                                value=len(self.supervisor.running()))
        yield CounterMetricFamily(
            "duebox_worker_process_restarts",
            "Worker processes this supervisor started again after one exited.",
            value=self.supervisor.restarts)
