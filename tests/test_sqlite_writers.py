"""SQLite: a process's writing transactions queue on one lock per engine
(core/db.py ``_SQLiteWriters``) instead of polling for SQLite's write lock
with the library's back-off, and the lock never outlives a transaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from duebox.db import create_sync_engine


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    eng = create_sync_engine(f"sqlite:///{tmp_path / 'w.db'}")
    with eng.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (i INTEGER)")
    yield eng
    eng.dispose()


def _second_writer(engine: sa.Engine, entered: threading.Event) -> threading.Thread:
    def write() -> None:
        with engine.begin() as conn:
            entered.set()
            conn.exec_driver_sql("INSERT INTO t VALUES (2)")

    t = threading.Thread(target=write)
    t.start()
    return t


@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_second_writer_waits_for_the_first_to_end(engine: sa.Engine, ending: str) -> None:
    entered = threading.Event()
    conn = engine.connect()
    tx = conn.begin()  # BEGIN IMMEDIATE: SQLite's write lock, and the engine's
    conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    second = _second_writer(engine, entered)
    # Blocked behind the first transaction (a negative wait: it fails at
    # once if the second writer is not held back).
    assert not entered.wait(0.5)
    getattr(tx, ending)()
    assert entered.wait(10), "the second writer never got in after the first ended"
    second.join(10)
    conn.close()
    with engine.connect() as check:
        rows = sorted(r[0] for r in check.exec_driver_sql("SELECT i FROM t"))
    assert rows == ([1, 2] if ending == "commit" else [2])


def test_a_deferred_transaction_takes_the_lock_at_its_first_write(engine: sa.Engine) -> None:
    entered = threading.Event()
    conn = engine.execution_options(duebox_sqlite_deferred=True).connect()
    tx = conn.begin()  # a plain BEGIN: no lock yet (a handler's transaction)
    second = _second_writer(engine, entered)
    assert entered.wait(10), "a transaction that has not written held the writers back"
    second.join(10)
    entered.clear()
    conn.exec_driver_sql("INSERT INTO t VALUES (3)")
    third = _second_writer(engine, entered)
    assert not entered.wait(0.5)
    tx.commit()
    assert entered.wait(10)
    third.join(10)
    conn.close()


def test_a_connection_lost_mid_transaction_lets_the_next_writer_in(engine: sa.Engine) -> None:
    entered = threading.Event()
    conn = engine.connect()
    conn.begin()
    conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    conn.invalidate()  # as when the driver reports the connection gone
    began = time.monotonic()
    second = _second_writer(engine, entered)
    assert entered.wait(10), "the lock outlived the lost connection"
    second.join(10)
    # Well under the 30 s the lock would otherwise be waited for.
    assert time.monotonic() - began < 5
    conn.close()
