"""What every ``duebox`` command shares: the app and operator options, text
arguments the database can store, and errors as one line.

A command never ends in a traceback: a bad option is click's usage error
(exit 2); a refused value, a missing privilege, missing tables or an
unreachable database is one line naming the cause and what to do (exit 1).
A database or broker that kept refusing the connection (a wrong login,
vhost, database or role: :class:`~duebox.errors.AccessRefusedError`) is one
line and exit 78, EX_CONFIG, so a process manager does not restart it in a
loop (docs/operators.md, "Exit statuses").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click
from sqlalchemy import exc as sa_exc

from duebox import AccessRefusedError, DueboxError
from duebox.db import db_errors
from duebox.validation import shown, text_problem

F = TypeVar("F", bound=Callable[..., Any])


def one_line(message: str) -> str:
    """``message`` as one printable line (a driver's error spans several)."""
    return shown(" ".join(message.split()))


# sysexits.h: "something was found in an unconfigured or misconfigured state".
EX_CONFIG = 78


class Refused(click.ClickException):
    """An AccessRefusedError as the command's one line: exit status 78."""

    exit_code = EX_CONFIG


def errors_as_messages(fn: F) -> F:
    """Run a command's body; what it raises on purpose, or a database error it
    did not expect, becomes one line and exit status 1 (78 for a refusal)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context(silent=True)
        action = ctx.command_path.removeprefix("duebox ") if ctx else fn.__name__
        try:
            with db_errors(action):
                return fn(*args, **kwargs)
        except AccessRefusedError as exc:
            raise Refused(one_line(f"{type(exc).__name__}: {exc}")) from exc
        except DueboxError as exc:
            raise click.ClickException(one_line(f"{type(exc).__name__}: {exc}")) from exc
        except sa_exc.SQLAlchemyError as exc:
            # A statement the database refused for its content (db_errors
            # handles the database's state): still one line, never a traceback.
            detail = getattr(exc, "orig", None) or exc
            raise click.ClickException(
                one_line(f"DatabaseError: {action}: the database refused it: {detail}")) from exc

    return wrapper  # type: ignore[return-value]


def app_options(fn: F) -> F:
    """--app, --database-url and --broker-url, shared by every command."""
    fn = click.option("--broker-url", envvar="DUEBOX_BROKER_URL", default=None,
                      help="Broker URL (sql://, redis://, amqp://, ...). "
                           "[env DUEBOX_BROKER_URL]")(fn)
    fn = click.option("--database-url", envvar="DUEBOX_DATABASE_URL", default=None,
                      help="SQLAlchemy URL of the database holding the outbox. "
                           "[env DUEBOX_DATABASE_URL]")(fn)
    fn = click.option("--app", "app_spec", envvar="DUEBOX_APP", default=None,
                      metavar="MODULE:ATTR",
                      help="Your duebox.Duebox instance, e.g. myproject.jobs:app. "
                           "[env DUEBOX_APP]")(fn)
    return errors_as_messages(fn)


def operator_options(fn: F) -> F:
    """--operator and --reason, both required, for every audited action."""
    fn = click.option("--reason", required=True, type=TEXT,
                      help="Why (recorded in the audit table).")(fn)
    return click.option("--operator", envvar="DUEBOX_OPERATOR", required=True, type=TEXT,
                        help="Who (recorded in the audit table). [env DUEBOX_OPERATOR]")(fn)


class StoredText(click.types.StringParamType):
    """A string the database can store: no NUL, and no lone surrogate (what
    Python makes of command-line bytes that are not UTF-8)."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        text = super().convert(value, param, ctx)
        if isinstance(text, str) and (problem := text_problem(text)) is not None:
            self.fail(problem, param, ctx)
        return text


TEXT = StoredText()


class FiniteRange(click.FloatRange):
    """A number in a range, and finite.  click's FloatRange lets NaN through
    (every comparison with it is false), and without a maximum infinity
    too: ``--window nan`` then ended in a traceback."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            rule = " and ".join(f"{word} {bound:.15g}" for word, bound in
                                (("at least", self.min), ("at most", self.max))
                                if bound is not None)
            self.fail(f"{number!r} is not a finite number{' ' + rule if rule else ''}",
                      param, ctx)
        return number


def unregistered_payloads_option(fn: F) -> F:
    """--show-unregistered-payloads for the commands that show one job: the
    option the masking note (duebox.masking) names."""
    return click.option(
        "--show-unregistered-payloads", "show_unregistered", is_flag=True,
        help="Show the payload of a task the app does not register (its mask hook is "
             "unknown, so it is hidden by default); the app's secret keys still apply.")(fn)
