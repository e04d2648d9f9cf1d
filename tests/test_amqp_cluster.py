"""A 3-node RabbitMQ cluster losing, by ``kill -9``, the node that holds the
queue leaders while delayed jobs wait in it (issue #35).

The cluster is the test's own (tests/services/rabbit_cluster.py: Debian's
``rabbitmq-server`` on free ports, killed in a ``finally``); the shared node
is not touched.  Queues are quorum queues and delays the TTL tiers
(``queue_type=quorum&delay_mode=tiers``, the mode docs/brokers.md advises
for a cluster: the delayed-message plugin keeps a message on one node).

What must hold: every job runs, once in effect (the effects table's primary
key) and never early, *without* the job table's republish —
``redeliver_after`` stays at 900 s, far beyond the test — so a message the
cluster confirmed and then lost with its node would leave its job
``ENQUEUED`` and fail the test.  The lateness is printed, not asserted
(bench/SOAK.md, "Failover").
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from backends import free_port
from cluster_failover import describe, failover
from conftest import IN_CI, reset_tables
from helpers import check_no_early_start, effect_rows, make_app, states
from services.rabbit_cluster import Cluster, available, rabbit_cluster

import duebox
from duebox.brokers.amqp import AMQPBroker

pytestmark = pytest.mark.timeout(150)

JOBS = 240
# Due from FIRST_DUE to FIRST_DUE + SPREAD seconds after scheduling: the
# node dies as soon as all are published, while every one waits in a tier.
FIRST_DUE, SPREAD = 6.0, 12.0
QUERY = "queue_type=quorum&delay_mode=tiers"


@pytest.mark.parametrize("mode", ["tiers", "plugin"])
async def test_a_node_that_is_down_is_passed_over(amqp_vhost: str, mode: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The first node of the URL refuses (nothing listens there): the broker
    connects through the second.  On plugin delays it warns that they are
    not replicated (the shared broker has the plugin; CI enables it)."""
    split = urlsplit(amqp_vhost)
    dead, port = free_port(), split.port or 5672
    url = urlunsplit(split._replace(netloc=f"{split.netloc.rpartition('@')[0]}@"
                                           f"127.0.0.1:{dead},{split.hostname}:{port}"))
    b = duebox.Duebox(database_url="sqlite://", broker_url=(
        f"{url}?delay_mode={mode}&prefix=cl{uuid.uuid4().hex[:8]}")).broker("test")
    assert isinstance(b, AMQPBroker)
    assert [p.port for p in b.pika_nodes] == [dead, port]
    with caplog.at_level(logging.WARNING, logger="duebox.brokers.amqp"):
        await b.open()
    try:
        link = await b._connected()
        assert link.params.port == port
    finally:
        await b.close()
    warned = [r for r in caplog.records if "keeps each message on the one node" in r.message]
    assert len(warned) == (mode == "plugin")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if not available():
        if IN_CI:
            pytest.fail("rabbitmq-server (Debian's package) is required under CI=true")
        pytest.skip("rabbitmq-server is not installed")
    with rabbit_cluster(3) as c:
        yield c


@pytest.mark.postgres
async def test_killing_the_leaders_node_loses_no_job(pg_server_url: str,
                                                     cluster: Cluster) -> None:
    reset_tables(pg_server_url)
    app = make_app(pg_server_url, cluster.url(query=QUERY), lease_seconds=30.0)
    run = await failover(app, cluster, jobs=JOBS, first_due=FIRST_DUE, spread=SPREAD,
                         wait=60)
    print(f"\nkilled {run.victim} {(run.killed_at - run.start).total_seconds():.1f} s after "
          f"scheduling; all {JOBS} jobs done {run.done_after:.1f} s later")
    rows = effect_rows(app.engine)
    assert sorted(rows) == sorted(map(str, [run.first, *run.ids]))  # each ran, once in effect
    check_no_early_start(app.engine)
    assert states(app.engine) == {"SUCCEEDED": JOBS + 1}
    for what, ms in run.lateness(app):
        print(f"lateness, {what}: {describe(ms)}")
