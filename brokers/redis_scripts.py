"""The Lua scripts of the ``redis://`` backend.

Each is a file of its own (``brokers/lua/redis_NAME.lua``, shipped as package
data) that states its KEYS and ARGV at the top: an editor highlights it and
a reader finds it by name, as in dramatiq.  Read once per process.
"""

from __future__ import annotations

import functools
from importlib import resources

NAMES = ("publish", "move", "ack", "defer", "cancel", "missing", "hand_on")


@functools.cache
def source(name: str) -> str:
    """The Lua source of the script ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise KeyError(name)
    return (resources.files("duebox.brokers") / "lua" / f"redis_{name}.lua").read_text(
        encoding="utf-8")
