"""The backend contract on ``redis://`` under a key prefix of the test's
own, twice: against the real Redis, and against a Redis Cluster of the
session's own (3 primaries, 3 replicas: tests/services/redis_cluster.py).

The broker's restart (clause 9) is what each setup's operator meets:
standalone, the loss of every key under the prefix (what FLUSHALL or a
restart without AOF does); on the cluster, kill -9 of the primary serving
the test's queue, its replica taking over (a failover), then the dead node
started again, empty, to rejoin as a replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from backends import Keys
from helpers import Running

import duebox

from .base import BackendContract

pytestmark = [pytest.mark.contract, pytest.mark.backend_redis, pytest.mark.postgres]


class TestRedisContract(BackendContract):
    @pytest.fixture(params=["standalone", "cluster"])
    def broker_url(self, request: pytest.FixtureRequest) -> str:
        self.cluster: Any = None
        if request.param == "cluster":
            self.cluster = request.getfixturevalue("redis_cluster_nodes")
            self.keys: Keys = request.getfixturevalue("redis_cluster_keys")
        else:
            self.keys = request.getfixturevalue("redis_keys")
        # claim_idle=1: a dead consumer's pending entry is taken over quickly.
        return self.keys.url(claim_idle=1)

    @contextlib.asynccontextmanager
    async def broker_outage(self, app: duebox.Duebox,
                            running: Running) -> AsyncIterator[None]:
        if self.cluster is None:
            assert self.keys.wipe() >= 1
            yield
            return
        ready = self.keys.k("ready")
        primary = self.cluster.primary_of(ready)
        self.cluster.kill(primary)
        try:
            yield
            await asyncio.to_thread(self.cluster.wait_failover, primary, ready)
            assert self.cluster.primary_of(ready) is not primary
        finally:
            # The session's next test finds the cluster whole again.
            await asyncio.to_thread(self.cluster.restart, primary)
