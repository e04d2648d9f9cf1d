"""A RabbitMQ cluster of the test's own: nodes started from Debian's
``rabbitmq-server`` package on free ports, in a temporary folder, and
killed at the end.

The shared node (``rabbit@...`` on 5672, tests/backends.py) is never
touched: every node here has its own name (``duebox-<run>-<letter>@localhost``),
AMQP and distribution ports, Mnesia/log folders, config, enabled-plugins
file (empty: no management plugin, to save memory) and Erlang cookie (its
own ``HOME``).  They register with the machine's epmd, like any node.

The first node starts alone; the others find it through
``cluster_formation.classic_config`` and join it at their first boot, which
saves the ``stop_app``/``join_cluster``/``start_app`` round of
``rabbitmqctl`` calls (each a second of CPU on a 2-core machine).
:meth:`Cluster.members` asks the first node which nodes are running, to
check the cluster formed.

``with rabbit_cluster(3) as cluster:`` yields a :class:`Cluster`;
``cluster.kill(node)`` is ``kill -9`` of that node's Erlang VM.  On exit
every process the cluster started is killed (its own session) and the
folder removed, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from backends import free_port

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
# One scheduler and few async threads per node: three nodes share 2 cores
# with other test runs.  The default allocator arguments stay.
ERL_ARGS = "+S 1:1 +SDcpu 1:1 +SDio 2 +A 4"
START_TIMEOUT = 90.0


def available() -> bool:
    return os.path.exists(SERVER) and os.path.exists(CTL)


@dataclass
class Node:
    name: str
    amqp_port: int
    dist_port: int
    base: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid_file(self) -> Path:
        return self.base / "pid"

    def beam_pid(self) -> int:
        return int(self.pid_file.read_text().strip())

    def env(self, home: Path, seed: str) -> dict[str, str]:
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            "loopback_users = none\n"
            "disk_free_limit.absolute = 10MB\n"
            "log.console = false\n"
            "log.file.level = info\n"
            "cluster_formation.peer_discovery_backend = classic_config\n"
            f"cluster_formation.classic_config.nodes.1 = {seed}\n")
        (self.base / "rabbitmq-env.conf").write_text("")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update({
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.base / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": ERL_ARGS,
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        })
        return env


@dataclass
class Cluster:
    folder: Path
    nodes: list[Node] = field(default_factory=list)

    def url(self, *, vhost: str = "", query: str = "") -> str:
        """One ``amqp://`` URL naming every node (brokers/amqp_hosts.py)."""
        hosts = ",".join(f"127.0.0.1:{n.amqp_port}" for n in self.nodes)
        return f"amqp://guest:guest@{hosts}/{vhost}" + (f"?{query}" if query else "")

    def ctl_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env["HOME"] = str(self.folder)
        env["RABBITMQ_CONF_ENV_FILE"] = str(self.folder / "ctl-env.conf")
        return env

    def ctl(self, node: Node, *args: str, tool: str = CTL, timeout: float = 60.0) -> str:
        done = subprocess.run([tool, "-n", node.name, *args], env=self.ctl_env(),
                              capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(tool).name} {' '.join(args)} on {node.name} failed "
                               f"({done.returncode}): {done.stderr.strip() or done.stdout}")
        return done.stdout

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None
                and _pid_alive(n)]

    def members(self, via: Node | None = None) -> list[str]:
        """The running nodes, as ``via`` (the first live node) sees them."""
        via = via or self.alive()[0]
        status = json.loads(self.ctl(via, "cluster_status", "--formatter", "json"))
        return sorted(status["running_nodes"])

    def leaders(self, vhost: str) -> dict[str, str]:
        """Each queue of ``vhost`` and the node its leader (or its only
        copy, for a classic queue) is on."""
        alive = self.alive()
        rows = json.loads(self.ctl(alive[0], "list_queues", "-p", vhost, "name", "leader",
                                   "--formatter", "json"))
        found = {r["name"]: r.get("leader") or "" for r in rows}
        if not all(found.values()):  # classic queues: no leader, ask each node
            for node in alive:
                local = json.loads(self.ctl(node, "list_queues", "-p", vhost, "--local",
                                            "name", "--formatter", "json"))
                found.update({r["name"]: node.name for r in local if not found[r["name"]]})
        return found

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def add_vhost(self, vhost: str) -> None:
        via = self.alive()[0]
        self.ctl(via, "add_vhost", vhost)
        self.ctl(via, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")

    def kill(self, node: Node) -> None:
        """``kill -9`` the node's Erlang VM: no goodbye to its peers or
        clients, its sockets closed by the kernel."""
        os.kill(node.beam_pid(), signal.SIGKILL)
        assert node.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=10)

    def stop(self) -> None:
        for node in self.nodes:
            proc = node.proc
            if proc is None:
                continue
            # The node's shell wrapper, the VM and its helpers share the
            # session started for it; nothing else is in it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def _pid_alive(node: Node) -> bool:
    try:
        os.kill(node.beam_pid(), 0)
    except (OSError, ValueError):
        return False
    return True


def _start(node: Node, home: Path, seed: str) -> None:
    node.base.mkdir(parents=True)
    log = (node.base / "stdout.log").open("wb")
    node.proc = subprocess.Popen([SERVER], env=node.env(home, seed), stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 cwd=node.base)
    log.close()


def _await_listening(node: Node, deadline: float) -> None:
    """The AMQP listener opens last in a node's boot (after it joined its
    cluster): once it accepts, the node is ready for clients."""
    while True:
        assert node.proc is not None
        if node.proc.poll() is not None:
            raise RuntimeError(f"{node.name} exited with {node.proc.returncode} while "
                               f"starting; see {node.base / 'log'}")
        with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", node.amqp_port), timeout=1.0):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{node.name} did not listen on {node.amqp_port} within "
                               f"{START_TIMEOUT:g} s; see {node.base / 'log'}")
        time.sleep(0.2)


@contextlib.contextmanager
def rabbit_cluster(size: int = 3, plugins: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """``plugins``: enabled on every node (none by default)."""
    # In memory where the machine has a tmpfs: the test kills processes, not
    # the machine, so what a node wrote survives its kill -9 either way,
    # and a quorum queue's fsyncs cost nothing there (three nodes writing
    # through one disk beside other suites made 121 declarations take >30 s).
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = Path(tempfile.mkdtemp(prefix="duebox-rabbit-", dir=shm))
    run = uuid.uuid4().hex[:8]
    cluster = Cluster(folder)
    try:
        cookie = folder / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex.upper())
        cookie.chmod(0o600)
        (folder / "enabled_plugins").write_text(f"[{','.join(plugins)}].\n")
        (folder / "ctl-env.conf").write_text("")
        ports: set[int] = set()
        while len(ports) < 2 * size:  # free now: the same one may come twice
            ports.add(free_port())
        spare = sorted(ports)
        for i in range(size):
            letter = "abcdefgh"[i]
            cluster.nodes.append(Node(f"duebox-{run}-{letter}@localhost", spare[2 * i],
                                      spare[2 * i + 1], folder / letter))
        seed = cluster.nodes[0].name
        deadline = time.monotonic() + START_TIMEOUT
        _start(cluster.nodes[0], folder, seed)
        _await_listening(cluster.nodes[0], deadline)
        for node in cluster.nodes[1:]:
            _start(node, folder, seed)
        for node in cluster.nodes[1:]:
            _await_listening(node, deadline)
        members = cluster.members()
        if members != sorted(n.name for n in cluster.nodes):
            raise RuntimeError(f"the cluster formed as {members}, not of all {size} nodes")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
