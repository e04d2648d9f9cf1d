"""An app whose task keeps its result, for ``duebox jobs show`` in
tests/test_results.py: ``--app tests.apps.results_app:app``."""

import os
from typing import Any

import duebox

app = duebox.Duebox(database_url=os.environ.get("DUEBOX_DATABASE_URL", "sqlite:///cli.db"))


@app.task("total", store_result=True)
def total(payload: Any, ctx: duebox.JobContext) -> Any:
    return None
