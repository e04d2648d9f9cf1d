"""The backend contract on ``redis://`` against the real Redis, under a key
prefix of the test's own.  A restart is the loss of every key under that
prefix: for this backend exactly what FLUSHALL or a restart without AOF does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from backends import Keys
from helpers import Running

import duebox

from .base import BackendContract

pytestmark = [pytest.mark.contract, pytest.mark.backend_redis, pytest.mark.postgres]


class TestRedisContract(BackendContract):
    @pytest.fixture
    def broker_url(self, redis_keys: Keys) -> str:
        self.keys = redis_keys
        # claim_idle=1: a dead consumer's pending entry is taken over quickly.
        return redis_keys.url(claim_idle=1)

    @contextlib.asynccontextmanager
    async def broker_outage(self, app: duebox.Duebox,
                            running: Running) -> AsyncIterator[None]:
        assert self.keys.wipe() >= 1
        yield
