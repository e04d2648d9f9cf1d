"""Fixtures of the bad-input suite (the shared ones live in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import duebox


@pytest.fixture
def bare_app() -> Iterator[duebox.Duebox]:
    """An in-memory app with one task, ``t``: for checks that never reach SQL."""
    app = duebox.Duebox("sqlite://")
    app.add_task("t", lambda payload, ctx: None)
    yield app
    app.dispose()
