"""A Redis Cluster of the tests' own: 3 primaries and 3 replicas on free
ports in a folder of its own, from Debian's ``redis-server`` (7.0) and
``redis-cli``.  Never the shared server on 6379.

    with LocalCluster.started(tmp) as cluster:
        url = cluster.url()               # redis://127.0.0.1:P1,127.0.0.1:P2,.../0?cluster=1
        node = cluster.primary_of("k")    # the primary serving that key's slot
        cluster.kill(node)                # kill -9
        cluster.wait_failover(node)       # until its replica serves the slot
        cluster.restart(node)             # back, as a replica of the new primary

Every node runs with no persistence (``--appendonly no --save ''``), as
duebox's tests run Redis; ``cluster-node-timeout`` is short so a failover
takes a few seconds, and ``cluster-require-full-coverage no`` so the other
shards go on serving while one fails over (docs/brokers.md recommends it).

As a script, for bench/ and by hand (foreground; Ctrl-C stops every node)::

    python tests/services/redis_cluster.py run [--dir DIR]   # prints "ready URL"
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends import poll

NODE_TIMEOUT_MS = 2000


def os_free_port() -> int:
    """A port the kernel says is free now (the tests pass backends.free_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    port: int
    bus: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout: float = 10) -> str:
        """``redis-cli -p PORT ARGS``: its output."""
        return subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                              text=True, timeout=timeout, check=True).stdout

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    def __init__(self, folder: Path, free_port: Callable[[], int] = os_free_port,
                 nodes: int = 6) -> None:
        self.folder = folder
        taken: set[int] = set()

        def port() -> int:
            while (p := free_port()) in taken:
                pass
            taken.add(p)
            return p

        # The bus port is given explicitly (``cluster-port``): port + 10000,
        # Redis's default, may be taken or past 65535.
        self.nodes = [Node(port(), port(), folder / f"node{i}") for i in range(nodes)]

    @classmethod
    @contextlib.contextmanager
    def started(cls, folder: Path, free_port: Callable[[], int] = os_free_port
                ) -> Iterator[LocalCluster]:
        """Start the cluster; every node is stopped (SIGKILL if it must) at the end."""
        cluster = cls(folder, free_port)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()

    # --- lifecycle -------------------------------------------------------------------

    def _spawn(self, node: Node) -> None:
        node.folder.mkdir(parents=True, exist_ok=True)
        log = (node.folder / "redis.log").open("ab")
        node.proc = subprocess.Popen(
            ["redis-server", "--port", str(node.port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-port", str(node.bus),
             "--cluster-config-file", str(node.folder / "nodes.conf"),
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--cluster-require-full-coverage", "no",
             "--appendonly", "no", "--save", "", "--dir", str(node.folder),
             # A replica syncs at once, not after diskless sync's 5 s wait.
             "--repl-diskless-sync-delay", "0",
             "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        poll(f"redis-server on {node.port}", lambda: _answers(node), 20,
              lambda: _still_running(node))

    def start(self) -> None:
        for node in self.nodes:
            self._spawn(node)
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(n.address for n in self.nodes),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       capture_output=True, check=True, timeout=60)
        poll("the cluster to be ready", self.ready, 60)

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(10)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait(10)

    def kill(self, node: Node) -> None:
        """kill -9."""
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(10)

    def restart(self, node: Node) -> None:
        """Start a killed node again: empty (no persistence), it rejoins from
        its nodes.conf and, its shard failed over meanwhile, as a replica."""
        self._spawn(node)
        poll(f"{node.address} to rejoin as a replica", lambda: self.role(node) == "slave"
              and self.ready(), 60)

    # --- what the nodes say ----------------------------------------------------------

    def url(self, **params: object) -> str:
        """The ``redis://`` URL with every node as a seed (``cluster=1``
        implied by the several hosts, said anyway)."""
        query = "&".join(f"{k}={v}" for k, v in {"cluster": 1, **params}.items())
        return f"redis://{','.join(n.address for n in self.nodes)}/0?{query}"

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    def ready(self) -> bool:
        """Every live node says the cluster is ok, with every slot served by
        a node it does not take for failing, and every live replica is in
        sync with its primary (one still loading could not take over)."""
        try:
            return all(_node_ready(node) for node in self.live())
        except (subprocess.SubprocessError, OSError):
            return False

    def role(self, node: Node) -> str:
        try:
            return node.cli("role").split("\n", 1)[0].strip()
        except subprocess.SubprocessError:
            return "down"

    def primary_of(self, key: str, view: Node | None = None) -> Node:
        """The primary serving ``key``'s slot, as ``view`` (the first live
        node) sees it."""
        view = view or self.live()[0]
        slot = int(view.cli("cluster", "keyslot", key))
        for line in view.cli("cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            for part in fields[8:]:
                lo, _, hi = part.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    port = int(fields[1].split(":")[1].split("@")[0])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no primary serves {key!r} in {view.address}'s view")

    def replica_of(self, primary: Node, timeout: float = 30) -> Node:
        """The live replica of ``primary`` (each primary has one here), as
        the replica itself says (``ROLE``): just after ``--cluster create``
        the others may not have heard of it yet."""
        def replica() -> Node | None:
            for node in self.live():
                with contextlib.suppress(subprocess.SubprocessError):
                    role = node.cli("role").split()
                    if role[:1] == ["slave"] and role[2:3] == [str(primary.port)] \
                            and role[3:4] == ["connected"]:
                        return node
            return None

        return poll(f"a replica of {primary.address}", replica, timeout)

    def wait_failover(self, dead: Node, key: str, timeout: float = 60) -> Node:
        """Wait until a replica serves ``key`` in place of the dead primary
        and every live node agrees; returns the new primary."""
        def promoted() -> Node | None:
            with contextlib.suppress(LookupError, subprocess.SubprocessError):
                views = {self.primary_of(key, view).port for view in self.live()}
                if len(views) == 1 and dead.port not in views and self.ready():
                    return self.primary_of(key)
            return None

        return poll(f"a replica to take over from {dead.address}", promoted, timeout)


def _node_ready(node: Node) -> bool:
    info = node.cli("cluster", "info")
    if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
        return False
    replication = node.cli("info", "replication")
    return "role:slave" not in replication or "master_link_status:up" in replication


def _answers(node: Node) -> bool:
    try:
        return node.cli("ping", timeout=2).strip() == "PONG"
    except (subprocess.SubprocessError, OSError):
        return False


def _still_running(node: Node) -> None:
    if node.proc is not None and node.proc.poll() is not None:
        log = node.folder / "redis.log"
        raise RuntimeError(f"redis-server on {node.port} exited:\n"
                           + (log.read_text()[-2000:] if log.exists() else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["run"])
    ap.add_argument("--dir", type=Path, help="the nodes' folder (default: a temporary one)")
    args = ap.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="duebox-redis-cluster-"))
    stop = False

    def stopping(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, stopping)
    try:
        with LocalCluster.started(folder) as cluster:
            print("ready", cluster.url(), flush=True)
            while not stop:
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
