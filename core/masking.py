"""What people may see of a task's data: the task's ``mask`` hook, failing closed.

Shared by everything that shows a job: the dashboard, ``duebox jobs show`` /
``dlq show``, and the worker's log line and stored traceback of a failure.

One function, :func:`masked`, decides for one job (or schedule) from its
task and payload, and what it returns masks both the payload and any text
that may quote the payload (an exception message in ``last_error`` or in an
attempt's error):

* a registered task without a hook: everything as it is;
* a hook: the payload as the hook returns it, and in error text every value
  the hook hid (a string or number in the raw payload that appears nowhere
  in the masked one) replaced by ``****``, also where it is quoted the way
  Python's ``repr`` or JSON quote it;
* a hook that raises, or a task this app does not register (so its hook is
  unknown): payload and error text both hidden, unless ``show_unregistered``
  (for unregistered tasks only).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Duebox
    from .tasks import Task

REDACTED = "****"


@dataclass(frozen=True)
class Masked:
    payload: Any  # what to show (None when hidden)
    note: str  # why it looks as it does ('' when shown as it is)
    secrets: tuple[str, ...] = ()  # what to cut out of text, longest first
    hidden: bool = False  # neither payload nor error text may be shown

    def text(self, value: str | None) -> str | None:
        """``value`` (error text) as it may be shown; None when hidden."""
        if self.hidden or value is None:
            return None
        for secret in self.secrets:
            value = value.replace(secret, REDACTED)
        return value


def _leaves(value: Any) -> Iterator[str]:
    """The strings and numbers in a JSON value, without recursion (a payload
    may be nested deeper than the interpreter's recursion limit)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
        elif isinstance(v, str):
            yield v
        elif isinstance(v, int | float) and not isinstance(v, bool):
            yield str(v)


def _quoted(secret: str) -> set[str]:
    return {secret, repr(secret)[1:-1], json.dumps(secret)[1:-1]} - {""}


def hidden_values(raw: Any, shown: Any) -> tuple[str, ...]:
    """What of ``raw`` the mask hook hid, as text to cut out, longest first."""
    kept = set(_leaves(shown))
    secrets = set()
    for leaf in set(_leaves(raw)) - kept:
        secrets |= _quoted(leaf)
    return tuple(sorted(secrets, key=lambda s: (-len(s), s)))


def masked(app: Duebox, task: str, payload: Any, *, show_unregistered: bool = False) -> Masked:
    """What of job data (``payload`` of task ``task``) people may see, per
    ``app``'s registration of the task."""
    return masked_for(app.tasks.get(task), payload, show_unregistered=show_unregistered)


def masked_for(registered: Task | None, payload: Any, *,
               show_unregistered: bool = False) -> Masked:
    """:func:`masked` for a task already looked up (None: not registered)."""
    if registered is None:
        if show_unregistered:
            return Masked(payload, "task not registered here: shown without a mask hook")
        return Masked(None, "hidden: the task is not registered in this app, so its "
                            "mask hook is unknown (give --app, or --show-unregistered-payloads)",
                      hidden=True)
    if registered.mask is None:
        return Masked(payload, "")
    try:
        shown = registered.mask(payload)
        secrets = hidden_values(payload, shown)
    except Exception as exc:
        return Masked(None, f"hidden: the task's mask hook raised {type(exc).__name__}",
                      hidden=True)
    return Masked(shown, "masked by the task's mask hook", secrets)


def masked_text(registered: Task | None, payload: Any, text: str) -> str:
    """Error text (a message, a traceback) as it may be written where people
    read it (a log line, the attempt's stored traceback)."""
    shown = masked_for(registered, payload, show_unregistered=True).text(text)
    return shown if shown is not None else f"({HIDDEN_TEXT})"


HIDDEN_TEXT = "error text hidden: the task's mask hook failed"


def shown_as_is(app: Duebox, task: str, *, show_unregistered: bool = False) -> bool:
    """Whether ``task``'s data is shown unmasked (so its payload need not be
    read to show its error text)."""
    registered = app.tasks.get(task)
    return show_unregistered if registered is None else registered.mask is None
