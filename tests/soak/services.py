"""What each soak run stands on: its own PostgreSQL database, and for the
chosen backend its own broker corner (a private redis-server, a RabbitMQ
vhost, a private LocalStack or Kafka mock cluster), with the soak's TCP
proxy in front of whatever the network faults should hit.

Everything created here is removed in :meth:`Stand.close`; the shared
servers are only restarted by faults the caller asked for by name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import sqlalchemy as sa

from duebox import migrate
from tests.backends import (
    AMQP,
    LOCALSTACK,
    KafkaNames,
    Queues,
    free_port,
    kafka_mock,
    scratch_vhost,
    sqs_healthy,
    with_params,
)
from tests.soak.app import soak_metadata
from tests.soak.proxy import Proxy

PG_ADMIN_URL = os.environ.get("DUEBOX_TEST_PG", "postgresql+psycopg://127.0.0.1:5432/postgres")
BACKENDS = ("sql", "redis", "amqp", "sqs", "kafka")
HARNESS_APP_NAME = "duebox-soak-harness"


class SoakSetupError(RuntimeError):
    """A service the soak needs could not be prepared."""


def wait_until(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise SoakSetupError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)


def _with_host(url: str, host: str, port: int) -> str:
    parts = urlsplit(url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{auth}{host}:{port}"))


class PrivateRedis:
    """A redis-server of the soak's own (no persistence, like the shared
    one): restarting or flushing it touches nobody else's keys."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise SoakSetupError("redis-server is not installed")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="soak-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until("the private redis-server", self.ping, 20)

    def ping(self) -> bool:
        import redis

        try:
            with redis.Redis(port=self.port, socket_timeout=1) as r:
                return bool(r.ping())
        except redis.RedisError:
            return False

    def flushall(self) -> None:
        import redis

        with redis.Redis(port=self.port, socket_timeout=5) as r:
            r.flushall()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateLocalStack:
    """A LocalStack of the soak's own (localstack/start.sh on a free port,
    with its own pid file, log and state): stopping and restarting it loses
    nobody else's queues, so ``broker-restart`` is a safe fault on sqs://."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="soak-localstack-"))
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _script(self, command: str, timeout: float) -> subprocess.CompletedProcess[bytes]:
        env = {**os.environ, "LOCALSTACK_PORT": str(self.port), "LOCALSTACK_RUN": str(self.dir)}
        return subprocess.run([str(LOCALSTACK), command], env=env, capture_output=True,
                              timeout=timeout, check=False)

    def start(self) -> None:
        """Start it and wait until SQS answers (the script waits up to 60 s;
        the first run also installs LocalStack's virtual environment)."""
        out = self._script("start", 900)
        if out.returncode != 0 or not sqs_healthy(self.endpoint):
            raise SoakSetupError(f"LocalStack SQS did not start on port {self.port}: "
                                 + (out.stdout + out.stderr).decode(errors="replace")[-1000:])

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s: the emulator keeps nothing, every
        queue and message is gone."""
        self._script("stop", 60)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Stand:
    """The database and broker of one soak run."""

    backend: str
    max_delay: float
    database_url: str = ""  # the harness's own (direct) connection
    proc_database_url: str = ""  # what relays and workers use (through the proxy on sql://)
    broker_url: str = ""
    # The broker itself, around the proxy: where the "hostile" fault writes.
    direct_broker_url: str = ""
    proxy: Proxy | None = None
    redis: PrivateRedis | None = None
    localstack: PrivateLocalStack | None = None
    kafka_mock_as_is: bool = False
    queues: Queues | None = None
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    db_name: str = ""

    # --- setup ------------------------------------------------------------------

    def open(self) -> None:
        self._database()
        getattr(self, f"_{self.backend}")()

    def _database(self) -> None:
        self.db_name = f"duebox_soak_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{self.db_name}"'))
        except sa.exc.OperationalError as exc:
            raise SoakSetupError(f"PostgreSQL at {PG_ADMIN_URL}: {exc}") from exc
        finally:
            admin.dispose()
        self.cleanups.append(self._drop_database)
        self.database_url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + self.db_name
        self.proc_database_url = self.database_url
        engine = sa.create_engine(self.database_url)
        try:
            migrate.upgrade(engine)
            soak_metadata.create_all(engine)
        finally:
            engine.dispose()

    def _drop_database(self) -> None:
        admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)'))
        finally:
            admin.dispose()

    def _proxy_to(self, host: str, port: int) -> int:
        self.proxy = Proxy(host, port)
        self.cleanups.append(self.proxy.close)
        return self.proxy.start()

    def _sql(self) -> None:
        # The database is the broker: network faults go between it and duebox.
        parts = urlsplit(self.database_url)
        port = self._proxy_to(parts.hostname or "127.0.0.1", parts.port or 5432)
        self.proc_database_url = _with_host(self.database_url, "127.0.0.1", port)
        self.broker_url = "sql://"

    def _redis(self) -> None:
        self.redis = PrivateRedis()
        self.cleanups.append(self.redis.close)
        self.redis.start()
        port = self._proxy_to("127.0.0.1", self.redis.port)
        # claim_idle: a killed worker's unacknowledged entries are taken over
        # after 3 s instead of 30.
        self.broker_url = with_params(f"redis://127.0.0.1:{port}/0", prefix="soak",
                                      max_delay=self.max_delay, claim_idle=3)
        self.direct_broker_url = with_params(f"redis://127.0.0.1:{self.redis.port}/0",
                                             prefix="soak")

    def _amqp(self) -> None:
        vhost = f"duebox_soak_{uuid.uuid4().hex[:10]}"
        scratch = contextlib.ExitStack()
        self.cleanups.append(scratch.close)
        try:
            scratch.enter_context(scratch_vhost(vhost, urlsplit(AMQP).username or "guest"))
        except (OSError, subprocess.SubprocessError) as exc:
            raise SoakSetupError(f"RabbitMQ (rabbitmqctl add_vhost): {exc}") from exc
        parts = urlsplit(AMQP)
        port = self._proxy_to(parts.hostname or "127.0.0.1", parts.port or 5672)
        base = _with_host(AMQP.rstrip("/"), "127.0.0.1", port)
        self.broker_url = with_params(f"{base}/{vhost}", max_delay=self.max_delay, heartbeat=5)
        self.direct_broker_url = f"{AMQP.rstrip('/')}/{vhost}"

    def _sqs(self) -> None:
        self.localstack = PrivateLocalStack()
        self.cleanups.append(self.localstack.close)
        self.localstack.start()
        self.queues = queues = Queues(self.localstack.endpoint)
        port = self._proxy_to("127.0.0.1", self.localstack.port)
        # check_interval: a restarted (empty) LocalStack is noticed within 5 s
        # rather than 60 (with 60, one restart took 42 s to recover from;
        # bench/SOAK.md).
        self.broker_url = with_params(
            queues.url().replace(f"127.0.0.1:{self.localstack.port}", f"127.0.0.1:{port}"),
            max_delay=self.max_delay, check_interval=5)
        self.direct_broker_url = queues.url()

    def _kafka(self) -> None:
        # A mock cluster of the soak's own, on a free port with its own pid
        # file: the shared one on 19092 is started, stopped and SIGKILLed
        # (its restart test) by any test session running meanwhile, and each
        # of those is an empty new cluster under the soak.  Late SyncGroups
        # are answered as Kafka does (kafka_mock.py --fix-sync-group) unless
        # --kafka-mock-as-is: otherwise most rebalances fail their followers.
        # No proxy: the broker advertises its own address in its metadata, so
        # clients would connect around a proxy anyway.
        mock = kafka_mock()
        run = Path(tempfile.mkdtemp(prefix="soak-kafka-"))
        pidfile = run / "kafka-mock.pid"
        try:
            bootstrap = mock.start_background(free_port(), pidfile=pidfile,
                                              fix_sync_group=not self.kafka_mock_as_is)
        except RuntimeError as exc:
            raise SoakSetupError(str(exc)) from exc
        finally:
            self.cleanups.append(lambda: shutil.rmtree(run, ignore_errors=True))
        self.cleanups.append(lambda: mock.stop_background(pidfile))
        self.broker_url = self.direct_broker_url = KafkaNames(bootstrap).url()

    def broker_state(self) -> str:
        """What the broker holds now, for a failed run's diagnostics."""
        try:
            if self.backend == "amqp":
                vhost = self.broker_url.split("?")[0].rsplit("/", 1)[1]
                out = subprocess.run(
                    ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "messages_ready",
                     "messages_unacknowledged", "consumers"],
                    capture_output=True, timeout=60, check=False)
                return "\n" + out.stdout.decode()
            if self.backend == "redis" and self.redis is not None:
                import redis

                with redis.Redis(port=self.redis.port) as r:
                    return str({k.decode(): r.type(k).decode() for k in r.scan_iter("*")})
            if self.backend == "sqs" and self.queues is not None:
                return str(self.queues.counts())
        except Exception as exc:  # diagnostics only
            return f"unavailable: {exc!r}"
        return "n/a"

    def close(self) -> None:
        for fn in reversed(self.cleanups):
            with contextlib.suppress(Exception):
                fn()
        self.cleanups.clear()

    # --- the harness's own engine -------------------------------------------------------

    def engine(self) -> sa.Engine:
        """Tagged with an application name, so a connection-drop fault spares it."""
        return sa.create_engine(self.database_url, pool_pre_ping=True,
                                connect_args={"application_name": HARNESS_APP_NAME})
