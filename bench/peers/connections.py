"""How many TCP connections each of a workload's process groups holds to a
server's port, read from /proc (issue #35: connections per relay and per
worker process).

The servers are shared with the rest of the machine, so asking them
(``pg_stat_activity``, Redis ``CLIENT LIST``) would need a way to tell our
clients from others'; the client side knows its own sockets exactly: a
process's ``/proc/PID/fd`` links name socket inodes, and ``/proc/net/tcp``
(and ``tcp6``) give each inode's remote port and state.
"""

from __future__ import annotations

import os

from cpu import group_pids

_ESTABLISHED = "01"


def _remote_ports() -> dict[int, int]:
    """Socket inode → remote port, for every established TCP socket."""
    out: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)  # the header
                for line in f:
                    fields = line.split()
                    if fields[3] == _ESTABLISHED:
                        out[int(fields[9])] = int(fields[2].rsplit(":", 1)[1], 16)
        except OSError:
            continue
    return out


def _socket_inodes(pid: int) -> list[int]:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours
        return []
    out = []
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.append(int(link[8:-1]))
    return out


def by_group(pgids: dict[str, int], port: int) -> dict[str, int]:
    """Connections to ``port`` held by each named process group now."""
    remote = _remote_ports()
    return {name: sum(1 for pid in group_pids({pgid}) for inode in _socket_inodes(pid)
                      if remote.get(inode) == port)
            for name, pgid in pgids.items()}
