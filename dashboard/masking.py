"""Payloads as people may see them: the task's ``mask`` hook, failing closed."""

from __future__ import annotations

from typing import Any

from duebox import Duebox


def masked(app: Duebox, task: str, payload: Any, *,
           show_unregistered: bool = False) -> tuple[Any, str]:
    """(what to show, a note about it).  A registered task without a hook
    shows its payload; a hook that raises hides it rather than leak it; a task
    this app does not register (so its hook is unknown) is hidden unless
    ``show_unregistered``."""
    registered = app.tasks.get(task)
    if registered is None:
        if show_unregistered:
            return payload, "task not registered here: shown without a mask hook"
        return None, ("hidden: the task is not registered in the dashboard's app, so its mask "
                      "hook is unknown (give --app, or --show-unregistered-payloads)")
    if registered.mask is None:
        return payload, ""
    try:
        return registered.mask(payload), "masked by the task's mask hook"
    except Exception as exc:
        return None, f"hidden: the task's mask hook raised {type(exc).__name__}"
