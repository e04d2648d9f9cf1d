"""One worker process of ``duebox worker --processes N``, started by the
supervisor (cli/supervisor.py), never by hand::

    python -m duebox.cli.child SUPERVISOR_PID STATUS_FD [duebox arguments...]

It runs ``duebox [arguments]`` (a plain one-process ``duebox worker``) with
two differences:

* **It dies with its supervisor.** On Linux the kernel sends it SIGKILL when
  the supervisor dies (``prctl(PR_SET_PDEATHSIG)``), however the supervisor
  died — SIGKILL, the OOM killer, a crash. Elsewhere, and for the moment
  between its start and that call, it checks its parent pid. A worker nobody
  supervises would run jobs that nobody stops; killed, its jobs go back to
  ``SCHEDULED`` as soon as the relay sees its liveness lock free
  (docs/design.md, "Liveness").
* **A configuration error is final.** It exits with ``EX_CONFIG`` (78, from
  sysexits.h) and writes its one-line message to ``STATUS_FD``, so the
  supervisor stops with that error instead of restarting a process that
  would fail the same way every time. Any other failure exits as the
  command would (1), and the supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

import click

from duebox.errors import ConfigurationError, ValidationError

from .options import EX_CONFIG

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How often a process without PR_SET_PDEATHSIG looks at its parent pid.
_PARENT_CHECK_SECONDS = 0.5


def parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel for ``sig`` when this process's parent dies (Linux
    only: False elsewhere, or when the call fails)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return bool(prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)


def die_with_parent(parent: int, *, use_prctl: bool = True) -> None:
    """SIGKILL this process when ``parent`` (its parent's pid now) is gone.

    The kernel's signal is sent when the parent dies *after* the call, and a
    parent that died before it has already handed this process to another
    (init, a subreaper): so the parent pid is checked once right after it,
    and where the kernel offers no such signal (or ``use_prctl`` is False,
    for the tests of this fallback) by a daemon thread, twice a second."""
    if use_prctl and parent_death_signal(signal.SIGKILL):
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="duebox-parent-watch", daemon=True).start()


def _is_configuration(exc: click.ClickException) -> bool:
    """A usage error, or a command error caused by a bad setting or value."""
    return isinstance(exc, click.UsageError) or isinstance(
        exc.__cause__, ConfigurationError | ValidationError)


def _report(status_fd: int, message: str) -> None:
    with contextlib.suppress(OSError):  # the supervisor may be gone: we are too, then
        os.write(status_fd, message.encode("utf-8", "replace")[:4096])


def main(argv: list[str]) -> int:
    """Run ``duebox argv[2:]`` as a supervised child; the exit status."""
    if len(argv) < 2 or not argv[0].isdigit() or not argv[1].isdigit():
        print("usage: python -m duebox.cli.child SUPERVISOR_PID STATUS_FD ARGS... "
              "(started by `duebox worker --processes N`)", file=sys.stderr)
        return 2
    parent, status_fd = int(argv[0]), int(argv[1])
    die_with_parent(parent)
    os.set_inheritable(status_fd, False)  # not for the handlers' own subprocesses
    from .main import cli

    try:
        code = cli.main(args=argv[2:], prog_name="duebox", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        if _is_configuration(exc):
            _report(status_fd, exc.format_message())
            return EX_CONFIG
        return exc.exit_code
    except (click.Abort, KeyboardInterrupt):  # Ctrl-C before the worker's handlers
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
