"""Shared fixtures: real SQLite files and real PostgreSQL databases, and an
isolated corner of the real Redis and RabbitMQ servers; LocalStack's SQS and
a Kafka-protocol broker, started for the session when CI did not start them.

Each test session creates its own PostgreSQL database (dropped at the end),
so tests never assume a clean shared one.  A service that cannot be reached
fails the test under ``CI=true`` and skips it, loudly, only on a developer
machine without it.

The suite runs in 3 processes (pytest-xdist, pyproject's addopts), each a
session of its own with its own databases, vhost, LocalStack and Kafka mock;
a test that stops or restarts a server they share is marked ``exclusive``
and runs alone.  tests/README.md, "In parallel", says what a new test needs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import exclusive

# Imported now, while only this thread runs: hypothesis' pytest plugin
# imports it lazily at the end of the session, and CPython 3.11.7's ast.parse
# can fail with "SystemError: AST constructor recursion depth mismatch" when
# another thread left over by a broker client parses at the same time
# (CPython gh-106905).
import hypothesis  # noqa: F401
import pytest
from backends import (
    AMQP,
    KAFKA,
    KAFKA_SERVER,
    OWN_KAFKA,
    OWN_SQS,
    REDIS,
    SQS,
    Keys,
    cluster_keys,
    free_port,
    kafka_reachable,
    kafka_server,
    localstack,
    redis_cluster,
    scratch_vhost,
    sqs_healthy,
)
from sqlalchemy import create_engine, text

import duebox
from duebox import migrate

PG_ADMIN_URL = os.environ.get("DUEBOX_TEST_PG", "postgresql+psycopg://127.0.0.1:5432/postgres")
MYSQL_ADMIN_URL = os.environ.get("DUEBOX_TEST_MYSQL", "mysql+pymysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# The processes `-n auto` runs the suite in (pytest_xdist_auto_num_workers).
WORKERS = 3
RUN_LOCK = exclusive.for_this_worker()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many processes ``-n auto`` (pyproject's addopts) runs the suite
    in: PYTEST_XDIST_AUTO_NUM_WORKERS, else WORKERS, whatever the machine.
    Each worker starts its own LocalStack and Kafka mock, and the suite is
    sized for the 2-core machines CI runs on (tests/README.md).  A run of
    the unit tier alone (``pytest tests/unit``) stays in one process: each
    worker would import and collect it again, which costs more than its
    tests (15 s in one process, 35 s in three, on CI's 2 cores)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return 0 if _unit_tier_only(config) else WORKERS


UNIT_TIER = Path(__file__).resolve().parent / "unit"


def _unit_tier_only(config: pytest.Config) -> bool:
    """Whether every path the command line names lies in tests/unit."""
    paths = [arg.split("::")[0] for arg in config.args]
    here = config.invocation_params.dir
    return bool(paths) and all((here / p).resolve().is_relative_to(UNIT_TIER) for p in paths)


def _parallel_controller(config: pytest.Config) -> bool:
    return (not hasattr(config, "workerinput")
            and config.pluginmanager.hasplugin("xdist")
            and config.getoption("dist", "no") != "no")


def pytest_configure(config: pytest.Config) -> None:
    if _parallel_controller(config):
        exclusive.make_folder()  # before the workers start: they inherit its name


def pytest_unconfigure(config: pytest.Config) -> None:
    if _parallel_controller(config):
        exclusive.remove_folder()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """In a parallel run, a test marked ``exclusive`` runs while no other
    test does (tests/exclusive.py); every other test runs beside the rest."""
    lock = RUN_LOCK
    if lock is None:
        return (yield)
    hold = lock.exclusive if item.get_closest_marker(exclusive.MARKER) else lock.shared
    with hold():
        return (yield)


def pytest_sessionstart(session: pytest.Session) -> None:
    from installed import missing_links

    missing = missing_links()
    if missing:
        pytest.exit(f"duebox's editable install predates {', '.join(missing[:5])}: "
                    "run `pip install -e .` again (see tests/installed.py)", returncode=4)


def service_missing(what: str, exc: BaseException) -> None:
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true and is not reachable: {exc}")
    pytest.skip(f"{what} not reachable: {exc}")


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session."""
    with pg_database() as url:
        yield url


@contextlib.contextmanager
def pg_database(prefix: str = "duebox_test") -> Iterator[str]:
    """A new, empty PostgreSQL database (no tables), dropped at the end."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        admin.dispose()
        service_missing("PostgreSQL", exc)
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def mariadb_server_url() -> Iterator[str]:
    """A fresh MariaDB/MySQL database for this test session."""
    name = f"duebox_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(MYSQL_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE `{name}`"))
    except Exception as exc:
        admin.dispose()
        service_missing("MariaDB", exc)
    url = MYSQL_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def reset_tables(url: str) -> None:
    """Drop duebox's tables and the tests' own, then migrate afresh."""
    eng = create_engine(url)
    with eng.begin() as conn:
        for table in ("effects", *reversed([t.name for t in duebox.metadata.sorted_tables]),
                      "duebox_alembic_version"):
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
    eng.dispose()
    engine = duebox.Duebox(database_url=url).engine
    migrate.upgrade(engine)
    engine.dispose()


def _migrated(request: pytest.FixtureRequest, tmp_path: object) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/duebox.db"  # type: ignore[str-bytes-safe]
    elif request.param == "mariadb":
        url = request.getfixturevalue("mariadb_server_url")
    else:
        url = request.getfixturevalue("pg_server_url")
    reset_tables(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: object) -> str:
    """A migrated, empty database: a SQLite file, then PostgreSQL."""
    return _migrated(request, tmp_path)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("mariadb", marks=pytest.mark.mariadb)])
def database_url_all(request: pytest.FixtureRequest, tmp_path: object) -> str:
    """:func:`database_url`, and MariaDB as well: for the invariants, which
    hold on every supported database (MariaDB for every test would add
    minutes to CI)."""
    return _migrated(request, tmp_path)


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("mariadb", marks=pytest.mark.mariadb)])
def server_url(request: pytest.FixtureRequest) -> str:
    """A migrated, empty database on a server (PostgreSQL, then MariaDB): for
    what only a server shows (its own clock, concurrent transactions)."""
    url: str = request.getfixturevalue(
        "pg_server_url" if request.param == "postgres" else "mariadb_server_url")
    reset_tables(url)
    return url


@pytest.fixture
def redis_keys() -> Iterator[Keys]:
    """A key prefix of this test's own on the real Redis, deleted at the end."""
    import redis

    prefix = f"t{uuid.uuid4().hex[:12]}"
    with redis.Redis.from_url(REDIS) as client:
        try:
            client.ping()
        except redis.RedisError as exc:
            service_missing("Redis", exc)
        k = Keys(client, prefix)
        try:
            yield k
        finally:
            k.wipe()


@pytest.fixture(scope="session")
def redis_cluster_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Redis Cluster of this session's own (3 primaries, 3 replicas, on
    free ports: tests/services/redis_cluster.py), started on first use and
    stopped at the end.  A test that kills a node starts it again before
    it ends (``LocalCluster.restart``): the next test finds 3 + 3."""
    import shutil

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        service_missing("redis-server and redis-cli (Debian's redis-server package)",
                        RuntimeError("not on PATH"))
    with redis_cluster().LocalCluster.started(tmp_path_factory.mktemp("redis-cluster"),
                                              free_port) as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_keys(redis_cluster_nodes: Any) -> Iterator[Keys]:
    """:func:`redis_keys` on this session's Redis Cluster."""
    with cluster_keys(redis_cluster_nodes) as keys:
        yield keys


@pytest.fixture(scope="session")
def amqp_vhost() -> Iterator[str]:
    """A fresh RabbitMQ vhost for this test session: its URL, without query."""
    import pika
    import pika.exceptions

    name = f"duebox_test_{uuid.uuid4().hex[:10]}"
    url = f"{AMQP.rstrip('/')}/{name}"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(scratch_vhost(name, urlsplit(AMQP).username or "guest"))
            pika.BlockingConnection(pika.URLParameters(url)).close()
        except (OSError, subprocess.SubprocessError, pika.exceptions.AMQPError) as exc:
            service_missing("RabbitMQ (with rabbitmqctl)", RuntimeError(f"{url}: {exc!r}"))
        yield url


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[str]:
    """LocalStack's SQS: DUEBOX_TEST_SQS_ENDPOINT's, else one this session
    starts on a port of its own with localstack/start.sh (its first run
    installs LocalStack into LOCALSTACK_VENV) and stops."""
    if not OWN_SQS:
        if not sqs_healthy(SQS):
            service_missing("LocalStack SQS", RuntimeError(f"nothing answers at {SQS}"))
        yield SQS
        return
    started = localstack("start")
    if started.returncode != 0 or not sqs_healthy(SQS):
        service_missing("LocalStack SQS (localstack/start.sh)",
                        RuntimeError(started.stderr.decode()[-2000:]))
    try:
        yield SQS
    finally:
        localstack("stop", timeout=60)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """A Kafka-protocol broker: DUEBOX_TEST_KAFKA's, else librdkafka's mock
    cluster (tansu with DUEBOX_TEST_KAFKA_SERVER=tansu), started (and
    stopped) here on a port of this session's own."""
    if not OWN_KAFKA:
        if not kafka_reachable(KAFKA):
            service_missing("Kafka", RuntimeError(f"nothing listens at {KAFKA}"))
        yield KAFKA
        return
    port = int(KAFKA.rsplit(":", 1)[1])
    try:
        server = kafka_server()
        address = server.start_background(port)
    except (OSError, RuntimeError, ImportError) as exc:
        service_missing(f"the session's Kafka ({KAFKA_SERVER}; pip install -e '.[dev]')", exc)
    try:
        yield address
    finally:
        server.stop_background(server.pidfile_for(port))


@pytest.fixture
def roomy_group_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches as large as what is waiting: a loaded machine must not cut
    them at the 50 ms budget, nor let a handler go as a straggler after
    20 ms (tests of those set their own).  ``pytestmark =
    pytest.mark.usefixtures(...)`` in a file."""
    from duebox.consumers import policy

    monkeypatch.setattr(policy, "BUDGET", 5.0)
    monkeypatch.setattr(policy, "STRAGGLER_AFTER", 5.0)
    monkeypatch.setattr(policy, "LONG_ALONE_AFTER", 5.0)


@pytest.fixture
def runner(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A click runner for ``duebox`` against ``database_url``, with
    ``tests.apps.cli_app:app`` pointed at it (and no operator in the env)."""
    from click.testing import CliRunner

    from tests.apps import cli_app

    monkeypatch.setenv("DUEBOX_DATABASE_URL", database_url)
    monkeypatch.delenv("DUEBOX_OPERATOR", raising=False)
    cli_app.app.configure(database_url=database_url)
    yield CliRunner()
    cli_app.app.dispose()


def _reruns(config: pytest.Config) -> list[Any]:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return list(reporter.stats.get("rerun", [])) if reporter is not None else []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """A rerun is a failure: print why each rerun test failed (should someone
    run with pytest-rerunfailures' ``--reruns``); the session then fails."""
    reruns = terminalreporter.stats.get("rerun", [])
    if not reruns:
        return
    terminalreporter.section("FAILED: tests that passed only when rerun", red=True)
    for rep in reruns:
        text = getattr(rep, "longreprtext", "") or str(rep.longrepr)
        terminalreporter.write_line(f"--- {rep.nodeid}")
        for line in text.splitlines()[-60:]:
            terminalreporter.write_line(line)
    terminalreporter.write_line(f"{len(reruns)} rerun(s): the session fails", red=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every flake is a bug (issue #24): a session that needed a rerun fails."""
    if _reruns(session.config) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
