"""``duebox worker --processes N``: the option, and what the worker command
hands the supervisor (cli/supervisor.py) to start N worker processes.

Duebox's own Python per job runs on one core per process (the GIL), so the
default, like Dramatiq's and Celery's, is one process per CPU this process
may run on.  ``--processes 1`` is the worker as it always was: this process,
no supervisor.

A child is a fresh interpreter running ``duebox worker --processes 1`` with
the options this command resolved: on its command line, except the database
and broker URLs (they may hold passwords), which go in its environment as
``DUEBOX_DATABASE_URL`` / ``DUEBOX_BROKER_URL``.  It imports ``--app`` anew,
on this process's ``sys.path``, in this process's working directory.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import click

from duebox.validation import shown

from .metrics_dir import MetricsDir
from .running import serve_metrics
from .supervisor import Supervisor, SupervisorCollector

ENV = "DUEBOX_PROCESSES"
# Each process holds its own database connections (256 × 8 handlers is
# already 2,048) and the supervisor a pipe per child: far above a sane count.
MOST = 256


def cpu_count() -> int:
    """The CPUs this process may run on: its affinity where the system has
    one (a container pinned to 2 of a host's 64 CPUs counts 2), else
    ``os.cpu_count()``."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


class ProcessCount(click.types.IntParamType):
    """A whole number of processes, 1 to :data:`MOST`, in ASCII digits
    (``int()`` would also take ``1_0``, ``٤`` and 10**400 digits)."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            text = str(value).strip()
            n = int(text) if text.isascii() and text.isdigit() and len(text) <= 6 else -1
        if not 1 <= n <= MOST:
            source = ctx.get_parameter_source(param.name) if ctx and param and param.name \
                else None
            where = f" (from {ENV})" if source is click.core.ParameterSource.ENVIRONMENT else ""
            self.fail(f"must be a whole number of processes from 1 to {MOST}{where}, "
                      f"got {shown(repr(value))[:40]}", param, ctx)
        return n


def _set_but_empty(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    # click reads an empty variable as unset; `DUEBOX_PROCESSES=` is more
    # likely a deployment's template that lost its value than a wish for
    # the default, which can differ per machine.
    if value is None and os.environ.get(ENV) == "":
        raise click.BadParameter(f"{ENV} is set but empty: set it to a number of processes "
                                 f"(1 to {MOST}) or unset it for one per CPU", ctx, param)
    return value


def processes_option(fn: Any) -> Any:
    return click.option(
        "--processes", envvar=ENV, type=ProcessCount(), default=None, callback=_set_but_empty,
        help=f"Worker processes, each with --concurrency handlers; 1 runs the worker in this "
             f"process alone (no supervisor). [env {ENV}; default: one per CPU, "
             f"{cpu_count()} here]")(fn)


def child_command(options: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment of every child, from the worker
    command's resolved ``options`` (and the root command's log options)."""
    args = [f"--log-level={options.get('log_level', 'INFO')}",
            f"--log-format={options.get('log_format', 'text')}", "worker", "--processes=1"]
    for name in ("app_spec", "concurrency", "group_commit"):
        if options[name] is not None:
            flag = "--app" if name == "app_spec" else "--" + name.replace("_", "-")
            args.append(f"{flag}={options[name]}")
    args += [f"--queue={q}" for q in options["queues"]]
    if options.get("log_jobs"):
        args.append("--log-jobs")
    env = {k: v for k, v in os.environ.items()
           if k not in ("DUEBOX_METRICS_PORT", "DUEBOX_METRICS_HOST")}  # the supervisor's
    for name in ("database_url", "broker_url"):
        if options[name] is not None:
            env[f"DUEBOX_{name.upper()}"] = options[name]
    # The modules this process imports, the child imports: a script's own
    # folder (manage.py's), entries a launcher added.
    path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        [*path, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]))
    return args, env


def run_processes(count: int, options: dict[str, Any], metrics_port: int | None,
                  metrics_host: str) -> None:
    """Start ``count`` worker processes and supervise them until stopped."""
    if not sys.executable:
        raise click.UsageError("--processes: this Python does not know its own executable "
                               "(sys.executable), so it cannot start worker processes; "
                               "use --processes 1")
    args, env = child_command(options)
    metrics = MetricsDir() if metrics_port is not None else None
    server = None
    try:
        supervisor = Supervisor(count, args, {**env, **(metrics.env if metrics else {})},
                                metrics)
        if metrics is not None:
            registry = metrics.registry()
            registry.register(SupervisorCollector(supervisor))
            server = serve_metrics(metrics_port, metrics_host, registry)
        supervisor.run()
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if metrics is not None:
            metrics.remove()
