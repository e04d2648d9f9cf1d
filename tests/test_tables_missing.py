"""The producer API before ``duebox db upgrade`` (issue #33 item 6): one line
saying what to do, a :class:`duebox.TablesMissingError`, instead of the
database's 50-line traceback, on SQLite, PostgreSQL and MariaDB; the
caller's transaction is left usable (it is checked without a failing
statement, which PostgreSQL would answer by aborting the transaction); and
the check is made once per engine, not once per call."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import duebox
from duebox import migrate
from tests.badinput.common import scratch_database, scratch_mariadb

ORDERS = "CREATE TABLE orders (id INTEGER PRIMARY KEY)"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("mariadb", marks=pytest.mark.mariadb)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with the application's own table and none of duebox's."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/shop.db"
        scratch: contextlib.AbstractContextManager[str] = contextlib.nullcontext(url)
    elif request.param == "postgres":
        scratch = scratch_database("duebox_notables")
    else:
        scratch = scratch_mariadb("duebox_notables")
    with scratch as url:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text(ORDERS))
        engine.dispose()
        yield url


def make(url: str) -> duebox.Duebox:
    app = duebox.Duebox(url)

    @app.task("send-reminder")
    def send_reminder(payload: Any, ctx: duebox.JobContext) -> None:
        return None

    return app


def orders(app: duebox.Duebox) -> list[int]:
    with app.engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT id FROM orders ORDER BY id")).scalars())


def check_message(exc: duebox.TablesMissingError, action: str) -> None:
    text = str(exc)
    assert "\n" not in text
    assert text.startswith(f"{action}: no duebox tables in this database (")
    assert "run `duebox db upgrade`" in text
    assert "duebox.migrate.upgrade(app.engine)" in text
    assert isinstance(exc, duebox.DatabaseError)


def test_schedule_before_db_upgrade_says_so_and_leaves_the_transaction_usable(
    empty_url: str,
) -> None:
    app = make(empty_url)
    try:
        with Session(app.engine) as session, session.begin():
            session.execute(sa.text("INSERT INTO orders (id) VALUES (1)"))
            with pytest.raises(duebox.TablesMissingError) as caught:
                app.schedule(session, "send-reminder", {"order_id": 1}, delay=60)
            check_message(caught.value, "app.schedule")
            with pytest.raises(duebox.TablesMissingError):
                app.get_job(session, "reminder:1")
            with pytest.raises(duebox.TablesMissingError):
                app.schedule_many(session, [app.new_job("send-reminder", {"order_id": 1})])
            # The business write goes on in the same transaction and commits.
            session.execute(sa.text("INSERT INTO orders (id) VALUES (2)"))
        assert orders(app) == [1, 2]

        # Once the tables are there, the same app schedules: "missing" is
        # never remembered.
        migrate.upgrade(app.engine)
        with Session(app.engine) as session, session.begin():
            job_id = app.schedule(session, "send-reminder", {"order_id": 3}, delay=60)
        with Session(app.engine) as session:
            assert app.get_job(session, job_id).state == duebox.JobState.SCHEDULED
    finally:
        app.dispose()


@pytest.mark.parametrize("kind", ["session", "connection"])
async def test_the_async_forms_say_so_too(empty_url: str, kind: str) -> None:
    app = make(empty_url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if kind == "session":
                target: Any = await stack.enter_async_context(AsyncSession(app.async_engine))
                await stack.enter_async_context(target.begin())
            else:
                target = await stack.enter_async_context(app.async_engine.begin())
            await target.execute(sa.text("INSERT INTO orders (id) VALUES (7)"))
            with pytest.raises(duebox.TablesMissingError) as caught:
                await app.schedule(target, "send-reminder", {"order_id": 7})
            check_message(caught.value, "app.schedule")
            with pytest.raises(duebox.TablesMissingError):
                await app.cancel(target, uuid.uuid4())
            await target.execute(sa.text("INSERT INTO orders (id) VALUES (8)"))
        assert orders(app) == [7, 8]
    finally:
        await app.adispose()


def statements_per_schedule(app: duebox.Duebox, calls: int) -> list[int]:
    """How many statements each of ``calls`` schedules ran, its connection
    already open (a first connect runs statements of its own)."""
    with app.engine.connect():
        pass
    seen: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        seen.append(statement)

    sa.event.listen(app.engine, "before_cursor_execute", count)
    counts = []
    for n in range(calls):
        seen.clear()
        with Session(app.engine) as session, session.begin():
            app.schedule(session, "send-reminder", {"order_id": n})
        counts.append(len(seen))
    sa.event.remove(app.engine, "before_cursor_execute", count)
    return counts


def test_the_check_is_made_once_per_engine(empty_url: str) -> None:
    """After the first call on an engine finds the tables, a schedule runs
    exactly the statements it ran before the check existed: the check costs
    one query per engine, and then nothing but a set lookup."""
    app, other = make(empty_url), make(empty_url)
    try:
        migrate.upgrade(app.engine)
        first, *later = statements_per_schedule(app, 4)
        assert later == [later[0]] * 3
        assert first == later[0] + 1  # the tables' check, once
        # Another app's engine on the same database asks once for itself.
        assert statements_per_schedule(other, 2) == [first, later[0]]
    finally:
        app.dispose()
        other.dispose()
