"""duebox's pytest plugin (entry point ``pytest11``, loaded by pytest when
duebox is installed): the fixture ``duebox_harness``, your app made
testable for one test (duebox.testing.Harness), once your conftest.py says
which app is yours::

    # conftest.py
    import pytest
    from shop.jobs import app

    @pytest.fixture
    def duebox_app():
        return app

    # test_reminders.py
    def test_a_reminder_goes_out_a_day_later(duebox_harness):
        job_id = send_reminder.enqueue({"order_id": 42}, delay=86400)
        [info] = duebox_harness.run_due(until=86400)
        assert info.state == "SUCCEEDED"

``duebox.testing`` is imported when the fixture is first used, so the
plugin costs a test session that does not use it nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .app import Duebox
    from .testing import Harness


@pytest.fixture
def duebox_app() -> Duebox:
    """Your app: define a fixture of this name in your conftest.py that
    returns it."""
    pytest.fail("duebox_harness needs your app: define a fixture `duebox_app` in your "
                "conftest.py that returns it (docs/testing.md)", pytrace=False)


@pytest.fixture
def duebox_harness(duebox_app: Duebox, tmp_path: Path) -> Iterator[Harness]:
    """``duebox_app`` on a SQLite file in this test's ``tmp_path``, a
    ``memory://`` broker and a FakeClock, put back after the test;
    ``.run_due(until=...)`` runs its jobs (docs/testing.md)."""
    from .testing import Harness

    with Harness(duebox_app, database_url=f"sqlite:///{tmp_path / 'duebox.db'}") as harness:
        yield harness
