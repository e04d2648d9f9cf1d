"""What people may see of a task's data: the app's secret keys and the
task's ``mask`` hook, failing closed.

Shared by everything that shows a job: the dashboard, ``duebox jobs show`` /
``dlq show`` / ``dlq list``, and the worker's log line and stored traceback
of a failure.

One function, :func:`masked`, decides for one job (or schedule) from its
task and payload, and what it returns masks both the payload and any text
that may quote the payload (an exception message in ``last_error`` or in an
attempt's error):

* the payload as the task's hook returns it (as it is, without a hook), then
  the value of every secret key in it replaced by ``****`` (the app's
  ``mask_keys`` setting, or the task's own: duebox.secret_keys);
* in error text, every value so hidden (a string or number in the raw
  payload that appears nowhere in the masked one) replaced by ``****``,
  also where it is quoted the way Python's ``repr`` or JSON quote it, and
  the value after any secret key the text quotes (``'password': 'x'``,
  ``token=x``), whether or not it came from the payload;
* a task with neither a hook nor secret keys: everything as it is;
* a hook that raises, or a task this app does not register (so its hook is
  unknown): payload and error text both hidden, unless ``show_unregistered``
  (for unregistered tasks only: then the app's secret keys still apply).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .secret_keys import REDACTED, SecretKeys

if TYPE_CHECKING:
    from .app import Duebox
    from .tasks import Task

__all__ = ["REDACTED", "Masked", "hidden_values", "masked", "masked_for", "masked_text",
           "shown_as_is"]
_NO_KEYS = SecretKeys()


@dataclass(frozen=True)
class Masked:
    payload: Any  # what to show (None when hidden)
    note: str  # why it looks as it does ('' when shown as it is)
    secrets: tuple[str, ...] = ()  # what to cut out of text, longest first
    hidden: bool = False  # neither payload nor error text may be shown
    keys: SecretKeys = _NO_KEYS  # whose quoted values to cut out of text

    def text(self, value: str | None) -> str | None:
        """``value`` (error text) as it may be shown; None when hidden."""
        if self.hidden or value is None:
            return None
        for secret in self.secrets:
            value = value.replace(secret, REDACTED)
        return self.keys.scrub(value)

    def value(self, value: Any) -> Any:
        """Another JSON value of the job (its result, duebox.reads.results) as it
        may be shown, masked like the payload: the values of secret keys
        replaced by ``****``, and every string in it that quotes what the
        payload's mask hid cut as error text is; None when hidden."""
        if self.hidden:
            return None
        if not self.secrets:
            return self.keys.mask(value)
        # A copy to scrub in place (mask() returns the value itself when no
        # key is secret); a JSON value comes back equal through JSON.
        holder: list[Any] = [json.loads(json.dumps(self.keys.mask(value)))]
        stack: list[tuple[Any, Any]] = [(holder, 0)]
        while stack:
            parent, slot = stack.pop()
            item = parent[slot]
            if isinstance(item, str):
                parent[slot] = self.text(item)
            elif isinstance(item, dict):
                stack.extend((item, k) for k in item)
            elif isinstance(item, list):
                stack.extend((item, i) for i in range(len(item)))
        return holder[0]


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
    return masked_for(app.tasks.get(task), payload, show_unregistered=show_unregistered,
                      keys=app.settings.secret_keys)


def masked_for(registered: Task | None, payload: Any, *,
               show_unregistered: bool = False, keys: SecretKeys = _NO_KEYS) -> Masked:
    """:func:`masked` for a task already looked up (None: not registered;
    then ``keys`` are the app's secret keys)."""
    if registered is None:
        if show_unregistered:
            return _applied(None, keys, payload, "task not registered here: shown without a "
                                                 "mask hook")
        return Masked(None, "hidden: the task is not registered in this app, so its "
                            "mask hook is unknown (give --app, or --show-unregistered-payloads)",
                      hidden=True)
    return _applied(registered.mask, registered.secret_keys, payload, "")


def _applied(hook: Callable[[Any], Any] | None, keys: SecretKeys, payload: Any,
             note: str) -> Masked:
    if hook is None and not keys:
        return Masked(payload, note)
    try:
        shown = keys.mask(hook(payload) if hook is not None else payload)
        secrets = hidden_values(payload, shown)
    except Exception as exc:
        return Masked(None, f"hidden: the task's mask hook raised {type(exc).__name__}",
                      hidden=True)
    if hook is not None:
        note = note or "masked by the task's mask hook"
    elif not note and shown != payload:
        note = "values of secret keys masked (mask_keys)"
    return Masked(shown, note, secrets, keys=keys)


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
    if registered is None:
        return show_unregistered and not app.settings.secret_keys
    return registered.mask is None and not registered.secret_keys
