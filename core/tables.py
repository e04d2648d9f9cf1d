"""The tables, on one :data:`metadata` (SQLAlchemy 2.0 Core).

All names carry the ``duebox_`` prefix so they sit beside an application's own
tables in its own database: the outbox must share the application's
transaction.  Alembic migrations in :mod:`duebox.migrations` create them; a
test in the suite checks the migrations and this module agree.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator, TypeEngine

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC instant on every dialect.

    SQLite and MySQL have no zone-aware timestamp; values are stored as UTC and
    handed back aware, so comparisons never depend on a server or machine zone.

    On MySQL/MariaDB it is ``DATETIME(6)``: a bare ``DATETIME`` keeps whole
    seconds, so a job due at 12:00:00.7 would be stored (MariaDB truncates)
    as 12:00:00 and could start early.  Migration 0004 widens older tables.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(timezone=True, fsp=6))
        return self.impl_instance

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime reached the database layer")
        value = value.astimezone(UTC)
        if dialect.name != "postgresql":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class ExactName(TypeDecorator[str]):
    """A key or name compared character for character on every dialect.

    MySQL/MariaDB's default collation is case- and accent-insensitive and
    ignores trailing spaces: ``key="ABC"`` would find the job of
    ``key="abc"`` and schedule nothing.  There these columns are binary
    without padding; migration 0005 converts older tables."""

    impl = String
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            collation = ("utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False)
                         else "utf8mb4_0900_bin")
            length = getattr(self.impl_instance, "length", None)
            return dialect.type_descriptor(mysql.VARCHAR(
                length, charset="utf8mb4", collation=collation))
        return self.impl_instance


def _dt(name: str, nullable: bool = True, **kw: Any) -> Column[datetime]:
    return Column(name, UTCDateTime(), nullable=nullable, **kw)


JsonType = JSON().with_variant(JSONB(), "postgresql")

# Jobs hash into this many fixed slots (``shard`` column, set at insert from
# the id); relays that shard split the slots into contiguous ranges, so the
# number of relay shards can change without rewriting a row.
SHARD_SLOTS = 1024


def shard_of(job_id: uuid.UUID) -> int:
    """The job's slot: the id's low bits (uuid7's random tail), stable forever."""
    return job_id.int % SHARD_SLOTS


def _shard_default(context: Any) -> int:
    return shard_of(context.get_current_parameters()["id"])


job = Table(
    "duebox_job",
    metadata,
    Column("id", Uuid(), primary_key=True),
    Column("task", ExactName(200), nullable=False),
    Column("queue", ExactName(200), nullable=False),
    Column("payload", JsonType, nullable=True),
    Column("headers", JsonType, nullable=True),
    _dt("due_at", nullable=False),
    Column("state", String(16), nullable=False),
    Column("version", Integer, nullable=False, default=1),
    Column("attempt", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    Column("tenant", ExactName(200), nullable=True),
    Column("key", ExactName(400), nullable=True),
    Column("schedule_id", Uuid(), nullable=True),
    _dt("nominal_fire_at"),
    _dt("expires_at"),
    Column("lease_owner", String(200), nullable=True),
    _dt("lease_until"),
    Column("lease_generation", BigInteger, nullable=False, default=0),
    _dt("published_at"),
    Column("broker_message_id", String(400), nullable=True),
    Column("last_error", Text, nullable=True),
    Column("error_class", String(40), nullable=True),
    Column("checkpoint", JsonType, nullable=True),
    _dt("created_at", nullable=False),
    _dt("updated_at", nullable=False),
    _dt("claimed_at"),
    _dt("started_at"),
    _dt("finished_at"),
    # Added by migration 0003 (operating at scale, see docs/scale.md).
    Column("shard", SmallInteger, nullable=False, default=_shard_default),
    # Added by migration 0008: the broker route the job was last handed to
    # (core/reroute.py), so a queue moved to another broker can be re-routed.
    Column("published_to", String(255), nullable=True),
    UniqueConstraint("key", name="uq_duebox_job_key"),
    UniqueConstraint("schedule_id", "nominal_fire_at", name="uq_duebox_job_occurrence"),
    # The claim: state = 'SCHEDULED' AND due_at <= :horizon ORDER BY due_at.
    Index("ix_duebox_job_state_due", "state", "due_at"),
    # The recovery scan: leased states whose lease_until has passed.
    Index("ix_duebox_job_state_lease", "state", "lease_until"),
    # The fair claim: one bounded, index-ordered read per (queue, tenant, priority).
    Index("ix_duebox_job_class_due", "state", "queue", "tenant", "priority", "due_at"),
    # The relay's sweep for jobs left on an old route (core/reroute.py).
    Index("ix_duebox_job_state_route", "state", "published_to"),
)

attempt = Table(
    "duebox_attempt",
    metadata,
    Column("id", Uuid(), primary_key=True),
    Column("job_id", Uuid(), nullable=False),
    Column("number", Integer, nullable=False),
    Column("worker", String(200), nullable=True),
    Column("lease_generation", BigInteger, nullable=False),
    Column("outcome", String(20), nullable=True),
    Column("error_class", String(40), nullable=True),
    Column("error", Text, nullable=True),
    _dt("started_at", nullable=False),
    _dt("finished_at"),
    # Added by migration 0006: the failure's traceback, bounded and masked.
    Column("traceback", Text, nullable=True),
    Index("ix_duebox_attempt_job", "job_id", "number"),
)

processed = Table(
    "duebox_processed",
    metadata,
    Column("consumer", String(200), primary_key=True),
    Column("message_id", String(200), primary_key=True),
    _dt("processed_at", nullable=False),
)

lease = Table(
    "duebox_lease",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("owner", String(200), nullable=True),
    Column("epoch", BigInteger, nullable=False, default=0),
    _dt("expires_at"),
    Column("info", JsonType, nullable=True),
)

rate_bucket = Table(
    "duebox_rate_bucket",
    metadata,
    # Token buckets shared by every relay (docs/scale.md): ``global``,
    # ``queue:<name>``, ``tenant:<name>``.  Rate and burst live in the relays'
    # configuration; the row holds only the shared state.
    Column("name", ExactName(200), primary_key=True),
    Column("tokens", Float, nullable=False),
    _dt("updated_at", nullable=False),
)

audit = Table(
    "duebox_audit",
    metadata,
    Column("id", Uuid(), primary_key=True),
    _dt("at", nullable=False),
    Column("operator", String(200), nullable=False),
    Column("action", String(40), nullable=False),
    Column("job_id", Uuid(), nullable=True),
    Column("reason", Text, nullable=False),
    Column("details", JsonType, nullable=True),
    Index("ix_duebox_audit_job", "job_id"),
)

schedule = Table(
    "duebox_schedule",
    metadata,
    Column("id", Uuid(), primary_key=True),
    Column("name", ExactName(200), nullable=False),
    Column("task", ExactName(200), nullable=False),
    Column("queue", ExactName(200), nullable=False),
    Column("cron", String(200), nullable=False),
    Column("timezone", String(64), nullable=False),
    Column("payload", JsonType, nullable=True),
    _dt("next_fire_at", nullable=True),
    Column("misfire_policy", String(16), nullable=False, default="fire_once"),
    Column("overlap_policy", String(16), nullable=False, default="allow"),
    Column("jitter_seconds", Integer, nullable=False, default=0),
    Column("version", Integer, nullable=False, default=1),
    Column("paused", Boolean, nullable=False, default=False),
    # Added by migration 0002 (recurring schedules, see duebox.schedules.api).
    Column("gap_policy", String(8), nullable=False, default="shift"),
    Column("fold_policy", String(8), nullable=False, default="first"),
    Column("priority", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False, default=3),
    Column("expire_after_seconds", Integer, nullable=True),
    _dt("last_fire_at"),
    _dt("created_at", nullable=False),
    _dt("updated_at", nullable=False),
    # Added by migration 0007 (schedules as code, see duebox.schedules.sync):
    # "api" for a schedule made by hand (app.schedules, the CLI), which the
    # relay's sync never touches; "code" for one declared next to its task.
    Column("origin", String(8), nullable=False, default="api"),
    # When the sync paused a "code" schedule because it left the code: only
    # such a pause is undone when the declaration comes back.
    _dt("retired_at"),
    UniqueConstraint("name", name="uq_duebox_schedule_name"),
    Index("ix_duebox_schedule_next", "paused", "next_fire_at"),
)

result = Table(
    "duebox_result",
    metadata,
    # Added by migration 0009 (duebox.reads.results): what the handler of a task
    # with store_result=True returned, as JSON text, written with the job's
    # completion and deleted by a relay once ``expires_at`` has passed.
    Column("job_id", Uuid(), primary_key=True),
    Column("value", Text, nullable=False),
    _dt("stored_at", nullable=False),
    _dt("expires_at", nullable=False),
    Index("ix_duebox_result_expires", "expires_at"),
)
