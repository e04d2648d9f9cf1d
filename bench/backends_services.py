"""Each broker backend's corner of its service, for one benchmark run.

A run gets its own Redis key prefix, RabbitMQ vhost, SQS queue prefix and
Kafka topic prefix + consumer group, and removes them at the end.  LocalStack
and the Kafka mock are started here for the run, on free ports of their own
(and stopped again), with the helpers the test suite uses
(``tests/backends.py``): one way to start them, not two.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("redis", "amqp", "sqs", "kafka")
# LocalStack's virtual environment is cached across runs (as .ci/run does).
LOCALSTACK_VENV = Path.home() / ".cache" / "duebox" / "localstack-venv"


def test_backends() -> ModuleType:
    """``tests/backends.py`` under a name of its own (``bench/`` is first on
    ``sys.path`` and must not shadow or be shadowed by it)."""
    name = "duebox_test_backends"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "backends.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    import redis

    tb = test_backends()
    with redis.Redis.from_url(tb.REDIS) as client:
        keys = tb.Keys(client, f"bench{uuid.uuid4().hex[:10]}")
        try:
            yield keys.url()
        finally:
            keys.wipe()


@contextlib.contextmanager
def amqp_url(delay_mode: str = "tiers") -> Iterator[str]:
    """A fresh vhost (guest may use it), deleted at the end with everything in
    it.  The ``amqp`` section measures the tier topology whether or not the
    broker has the delayed-message plugin (``bench/amqp_delays.py`` compares
    the two)."""
    tb = test_backends()
    with tb.scratch_vhost(f"duebox_bench_{uuid.uuid4().hex[:10]}") as name:
        yield f"{tb.AMQP.rstrip('/')}/{name}?prefix=bench&delay_mode={delay_mode}"


def amqp_queues(url: str) -> list[tuple[str, int, int]]:
    """``rabbitmqctl list_queues name messages memory`` in the URL's vhost."""
    from urllib.parse import unquote, urlsplit

    vhost = unquote(urlsplit(url).path.lstrip("/")) or "/"
    out = test_backends().rabbitmqctl("list_queues", "-p", vhost, "--no-table-headers",
                      "name", "messages", "memory")
    rows = []
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[1].isdigit():
            rows.append((parts[0], int(parts[1]), int(parts[2])))
    return rows


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def sqs_endpoint() -> Iterator[str]:
    """``DUEBOX_BENCH_SQS_ENDPOINT``, else a LocalStack of this run's own on a
    free port (its own pid file and state), stopped at the end: a test
    session's LocalStack neither disturbs the figures nor is stopped here."""
    given = os.environ.get("DUEBOX_BENCH_SQS_ENDPOINT")
    if given:
        yield given
        return
    tb = test_backends()
    if not tb.OWN_SQS:  # DUEBOX_TEST_SQS_ENDPOINT names a running one: start and stop nothing
        yield tb.SQS
        return
    # tests/backends.py picked a free port of this process's own when it was
    # imported, and its localstack() starts LocalStack there whatever
    # LOCALSTACK_PORT says (a port chosen here instead was never listened on:
    # "LocalStack did not start" since per-session ports came in).
    endpoint = tb.SQS
    with tempfile.TemporaryDirectory(prefix="duebox-bench-localstack-") as run, _environ(
            LOCALSTACK_RUN=run,
            LOCALSTACK_VENV=os.environ.get("LOCALSTACK_VENV", str(LOCALSTACK_VENV))):
        LOCALSTACK_VENV.parent.mkdir(parents=True, exist_ok=True)
        try:
            started = tb.localstack("start")
            if started.returncode != 0 or not tb.sqs_healthy(endpoint):
                raise RuntimeError("LocalStack did not start (localstack/start.sh):\n"
                                   + started.stderr.decode()[-2000:])
            yield endpoint
        finally:
            tb.localstack("stop", timeout=60)


@contextlib.contextmanager
def sqs_url(endpoint: str) -> Iterator[str]:
    """A queue-name prefix of this run's own; its queues are deleted at the end."""
    queues = test_backends().Queues(endpoint)
    try:
        yield queues.url()
    finally:
        queues.delete_all()


@contextlib.contextmanager
def kafka_bootstrap() -> Iterator[str]:
    """``DUEBOX_BENCH_KAFKA``, else librdkafka's mock cluster started for this
    run on a free port (its own pid file), stopped at the end."""
    given = os.environ.get("DUEBOX_BENCH_KAFKA")
    if given:
        yield given
        return
    mock = test_backends().kafka_mock()
    with tempfile.TemporaryDirectory(prefix="duebox-bench-kafka-") as run:
        pidfile = Path(run) / "kafka-mock.pid"
        address: str = mock.start_background(0, pidfile=pidfile)
        try:
            yield address
        finally:
            mock.stop_background(pidfile)


def kafka_url(bootstrap: str, partitions: int = 4) -> str:
    """A topic prefix and consumer group of this run's own (the mock keeps
    topics in memory: nothing to delete on it)."""
    names = test_backends().KafkaNames(bootstrap)
    return str(names.url(partitions=partitions))


def service(backend: str) -> contextlib.AbstractContextManager[str]:
    """The service behind ``backend`` for a whole run: an SQS endpoint or a
    Kafka bootstrap address (started if need be); Redis and RabbitMQ run anyway."""
    starters: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {
        "sqs": sqs_endpoint, "kafka": kafka_bootstrap,
        "redis": lambda: contextlib.nullcontext(""), "amqp": lambda: contextlib.nullcontext(""),
    }
    if backend not in starters:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    return starters[backend]()


def namespace(backend: str, address: str) -> contextlib.AbstractContextManager[str]:
    """A broker URL in a namespace of its own, for one trial (``address`` from
    :func:`service`): no trial sees another's messages."""
    makers: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {
        "redis": redis_url, "amqp": amqp_url, "sqs": lambda: sqs_url(address),
        "kafka": lambda: contextlib.nullcontext(kafka_url(address)),
    }
    return makers[backend]()
