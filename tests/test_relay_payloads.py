"""What the relay publishes carries the payload the job table holds.

On PostgreSQL the relay's claims read a payload as jsonb's text and put it
into the message body unparsed (issue #20: parsing every payload only to
encode it again was the largest part of a claim's Python).  On every
database, through both claims (the fused mark + claim and the plain one)
and a real relay pass, the body must decode to the stored value, and a
row written by hand that no worker could decode must still reach the
worker as before: as an undecodable payload the worker dead-letters with
its reason, never as a body no worker can read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from helpers import make_app

import duebox
from duebox import FakeClock
from duebox.brokers.base import BrokerContext, Outgoing, PublishResult
from duebox.brokers.memory import MemoryBroker
from duebox.leases import claims
from duebox.leases.dispatch_marks import mark_and_claim
from duebox.message import STORED_MAX_DEPTH, JobMessage, UndecodableJSON
from duebox.relay import Relay
from duebox.tables import job

T0 = datetime(2030, 1, 1, tzinfo=UTC)

PAYLOADS: list[object] = [
    {"i": 1},
    {"text": "naïve ✓ 😀 \u202e \n\t\"quoted\" back\\slash", "nested": [[{"a": [1, 2]}]]},
    {"float": 1.5, "small": 1e-7, "big": 10**30, "neg": -0.0, "t": True, "n": None},
    [1, "two", {"three": 3}],
    "a bare string",
    12345,
    {"long": "9" * 700},  # a long digit run inside a string: parsed, and fine
    {"deep": json.loads("[" * 30 + "]" * 30)},
    {},
    None,
]


class Recording(MemoryBroker):
    def __init__(self, url: str, context: BrokerContext) -> None:
        super().__init__(url, context)
        self.bodies: dict[uuid.UUID, bytes] = {}

    async def publish(self, batch: Sequence[Outgoing]) -> list[PublishResult]:
        for out in batch:
            self.bodies[out.message.job_id] = out.message.encode()
        return await super().publish(batch)


@pytest.fixture
def app(database_url: str) -> Iterator[duebox.Duebox]:
    a = make_app(database_url, clock=FakeClock(T0))
    yield a
    a.dispose()


def _schedule(app: duebox.Duebox) -> dict[uuid.UUID, object]:
    with app.engine.begin() as conn:
        return {app.schedule(conn, "noop", payload): payload  # type: ignore[misc]
                for payload in PAYLOADS}


def _bodies(records: Sequence[claims.JobRecord]) -> dict[uuid.UUID, object]:
    return {r.id: JobMessage.decode(r.to_message().encode()).payload for r in records}


def test_both_claims_hand_on_the_stored_payload(app: duebox.Duebox) -> None:
    stored = _schedule(app)
    with app.engine.begin() as conn:
        plain = claims.claim_for_dispatch(conn, owner="r#1", horizon=T0, limit=5, now=T0,
                                          lease_until=T0 + timedelta(seconds=30))
    with app.engine.begin() as conn:
        _, fused = mark_and_claim(conn, marks=[("r#1", [r.id for r in plain])], owner="r#2",
                                  horizon=T0, limit=100, now=T0,
                                  lease_until=T0 + timedelta(seconds=30))
    assert len(plain) + len(fused) == len(PAYLOADS)
    assert {**_bodies(plain), **_bodies(fused)} == stored


async def test_a_relay_pass_publishes_the_stored_payload(app: duebox.Duebox) -> None:
    stored = _schedule(app)
    broker = Recording(f"memory://payloads-{uuid.uuid4().hex[:8]}",
                       BrokerContext(app.engine, app.clock, app.settings, "relay"))
    relay = Relay(app, broker=broker, batch_size=4)
    await relay.run_pass()
    assert relay.totals.marked == len(PAYLOADS)
    assert {i: JobMessage.decode(b).payload for i, b in broker.bodies.items()} == stored


def test_a_hand_written_payload_no_worker_could_decode_is_flagged(
        app: duebox.Duebox) -> None:
    """Nested deeper than a stored payload may be read back: the claim marks
    it undecodable (the worker dead-letters it with the reason) instead of
    putting a body no worker can parse on the broker."""
    job_id = _schedule(app).popitem()[0]
    deep = "[" * (STORED_MAX_DEPTH + 5) + "]" * (STORED_MAX_DEPTH + 5)
    with app.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # jsonb parses on input: the depth is the server's to accept.
            conn.execute(sa.text("UPDATE duebox_job SET payload = CAST(:p AS jsonb) "
                                 "WHERE id = :id"), {"p": deep, "id": job_id})
        else:
            conn.execute(sa.update(job).where(job.c.id == job_id)
                         .values(payload=sa.type_coerce(deep, sa.Text)))
        conn.execute(sa.update(job).where(job.c.id != job_id).values(state="CANCELLED"))
    with app.engine.begin() as conn:
        [rec] = claims.claim_for_dispatch(conn, owner="r#1", horizon=T0, limit=5, now=T0,
                                          lease_until=T0 + timedelta(seconds=30))
    assert isinstance(rec.payload, UndecodableJSON)
    # The body decodes (the payload travels as text); the worker's own read
    # of the row refuses it with the reason (check_stored_payload).
    assert JobMessage.decode(rec.to_message().encode()).job_id == job_id
