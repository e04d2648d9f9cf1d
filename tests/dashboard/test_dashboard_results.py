"""The job page and its JSON (``/api/jobs/ID``) show a kept result (issue
#33 item 4), masked like the payload: the values of secret keys as ``****``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from helpers import Running, make_app, memory_url

import duebox

from .conftest import Client

Serve = Callable[..., Client]


async def test_the_job_page_shows_the_result_masked(database_url: str, serve: Serve) -> None:
    app = make_app(database_url, memory_url())

    @app.task("signup", store_result=True)
    def signup(payload: Any, ctx: duebox.JobContext) -> Any:
        return {"user_id": 4217, "api_key": "ak-live-93f1"}

    job_id = app.enqueue("signup", {"email": "a@example.com"})
    async with Running(app):
        assert (await app.wait_for_async(job_id, timeout=60)).has_result
    client = serve(app)
    try:
        page = client.get(f"/jobs/{job_id}").text
        assert "<h2>Result</h2>" in page
        assert "4217" in page
        assert "ak-live-93f1" not in page
        assert "****" in page
        api = json.loads(client.get(f"/api/jobs/{job_id}").text)  # the JSON API: the same
        assert api["result"] == {"user_id": 4217, "api_key": "****"}
        assert api["has_result"] is True
    finally:
        client.server.stop()  # type: ignore[union-attr]
        app.dispose()
