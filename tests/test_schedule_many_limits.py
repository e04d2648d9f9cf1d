"""``schedule_many`` takes jobs built by ``new_job`` and no keys (README,
"Many jobs at once"): a keyed job is refused, naming it, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import duebox
from duebox import migrate
from duebox.tables import job


def test_a_keyed_job_is_refused_by_name_and_nothing_is_written(tmp_path: Path) -> None:
    app = duebox.Duebox(database_url=f"sqlite:///{tmp_path}/many.db")
    app.add_task("t", lambda payload, ctx: None)
    migrate.upgrade(app.engine)
    jobs = [app.new_job("t", 1), app.new_job("t", 2, key="k-2")]
    with Session(app.engine) as session, session.begin():
        with pytest.raises(duebox.ValidationError, match=r"jobs\[1\]\.key.*app\.schedule"):
            app.schedule_many(session, jobs)
        with pytest.raises(duebox.ValidationError, match=r"jobs\[0\].*new_job"):
            app.schedule_many(session, [{"task": "t"}])  # type: ignore[list-item]
        # The caller's transaction goes on: the keyed one one by one.
        ids = app.schedule_many(session, jobs[:1])
        ids.append(app.schedule(session, "t", 2, key="k-2"))
    with app.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(job)).scalar_one() == 2
    app.dispose()
