"""The unit tier: each module's contract at its boundary, on SQLite files and
the real ``memory://`` broker, with no service and no network.

``pytest tests/unit`` runs it alone in well under a minute (tests/README.md,
"Two tiers"); ``python -m pytest`` runs it with everything else.

Two guards keep the tier what it says:

* a test that opens a TCP or UDP connection fails (:func:`no_network`):
  a test that needs a server belongs to the integration tier (the guard
  sees Python's sockets; a driver that connects in C, libpq, is kept out
  by the next one);
* the service fixtures of tests/conftest.py (PostgreSQL, MariaDB, Redis,
  RabbitMQ, LocalStack, Kafka) fail here instead of connecting, and so do
  the database fixtures that include a server.
"""

from __future__ import annotations

import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import reset_tables

import duebox

_REAL = {"connect": socket.socket.connect, "connect_ex": socket.socket.connect_ex}


def _refusing(name: str) -> Any:
    real = _REAL[name]

    def guarded(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"tests/unit opens no network connection (to {address!r}): "
                                 "a test that needs a server belongs outside tests/unit")
        return real(sock, address)

    return guarded


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse every internet-family connection (TCP or UDP, loopback too).
    Unix sockets and socket pairs (the event loop's self-pipe) still work."""
    for name in _REAL:
        monkeypatch.setattr(socket.socket, name, _refusing(name))


# tests/conftest.py's fixtures that reach a service, or a database server.
SERVICE_FIXTURES = ("pg_server_url", "mariadb_server_url", "server_url", "database_url",
                    "database_url_all", "redis_keys", "amqp_vhost", "sqs_endpoint",
                    "kafka_bootstrap", "redis_cluster_nodes", "redis_cluster_keys")


def _refused(name: str) -> Any:
    @pytest.fixture(name=name)
    def refused() -> None:
        pytest.fail(f"tests/unit runs without services: {name} needs one; put this test "
                    "outside tests/unit (the integration tier)", pytrace=False)

    return refused


for _name in SERVICE_FIXTURES:
    globals()[f"_refused_{_name}"] = _refused(_name)


@dataclass
class Seconds:
    """A clock of seconds that moves only when the test sets ``now``, for
    the parts that take a ``clock: Callable[[], float]``."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def seconds() -> Seconds:
    return Seconds()


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite file migrated once per session: migrating costs ~0.2 s
    (Alembic rebuilds tables in batch mode on SQLite), a copy almost nothing."""
    path = tmp_path_factory.mktemp("unit-template") / "duebox.db"
    reset_tables(f"sqlite:///{path}")
    # Every connection is closed: the WAL was checkpointed into the one file.
    assert not any(path.parent.glob("duebox.db-*")), list(path.parent.iterdir())
    return path


@pytest.fixture
def sqlite_url(migrated_sqlite: Path, tmp_path: Path) -> str:
    """A migrated, empty SQLite database of this test's own."""
    path = tmp_path / "duebox.db"
    shutil.copyfile(migrated_sqlite, path)
    return f"sqlite:///{path}"


@pytest.fixture
def memory_url() -> str:
    """A ``memory://`` broker of this test's own (hubs are keyed by name)."""
    return f"memory://u{uuid.uuid4().hex[:12]}"


@pytest.fixture
def app(sqlite_url: str, memory_url: str) -> Iterator[duebox.Duebox]:
    """An app on this test's SQLite file and ``memory://`` broker, no task yet."""
    made = duebox.Duebox(sqlite_url, memory_url)
    yield made
    made.dispose()
