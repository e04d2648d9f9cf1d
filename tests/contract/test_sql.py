"""The backend contract on ``sql://``: workers claim rows from the job table."""

from __future__ import annotations

import pytest

from .base import BackendContract

pytestmark = [pytest.mark.contract, pytest.mark.backend_sql, pytest.mark.postgres]


class TestSQLContract(BackendContract):
    """No ``broker_outage``: clause 9 asserts the declared ``direct_claim``
    instead (there is no broker to restart; a PostgreSQL restart is out of
    scope here)."""

    @pytest.fixture
    def broker_url(self) -> str:
        return "sql://"
