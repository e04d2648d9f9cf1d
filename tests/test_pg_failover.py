"""PostgreSQL failover: the primary dies during a run, its standby is promoted.

Each test starts a primary and a streaming standby of its own
(tests/pg_pair.py: initdb, pg_basebackup, on free ports; stopped in a
``finally``), runs a relay and workers as real processes
(tests/procs/app_for_tests.py) on a multi-host URL with
``target_session_attrs=read-write``, and a producer thread scheduling one
job per transaction throughout.  Mid-run every process of the primary gets
SIGKILL and the standby is promoted with ``pg_ctl promote``; nothing of
duebox is restarted.

* **Synchronous replication**: nothing whose commit returned is lost, no
  job runs early, no job's effect commits twice, and the same relay and
  workers finish every job — the ones scheduled after the promotion too.
  One worker is paused (SIGSTOP) across the failover: its lease expires and
  the relay, finding its liveness lock gone on the new primary, takes it for
  dead; its jobs run elsewhere, and when it resumes, fencing makes its late
  writes match nothing, and it goes on working.
* **Liveness after a promotion**: with the old primary's port answering
  nothing (a powered-off host: every new connection to it waits for its
  connect timeout), no live process is taken for dead — the relay waits
  ``liveness.AFTER_SERVER_CHANGE`` once it sees the server changed.
* **Jobs mid-transaction at the kill** (their effect written, not yet
  committed): nothing of them committed; their workers settle them once
  the new primary takes writes, and they run again at once — well within
  their lease, after which recovery would have taken them back — once
  each, none early.
* **Asynchronous replication**: with the standby's WAL stream stopped
  (the primary's WAL sender paused), jobs scheduled meanwhile are lost with
  the primary (the RPO: docs/scale.md, "PostgreSQL failover"); what the
  standby had still completes, none of it early or twice.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from backends import Keys, Procs, free_port, poll
from conftest import IN_CI
from failover_scenario import (
    LAUNCHER,
    Producer,
    all_succeeded,
    answering,
    effect_runs,
    effects_count,
    job_states,
    prepare,
    registered,
    start_processes,
    takeovers,
)
from helpers import check_no_early_start, effects
from pg_pair import PgPair, available, silent_host

import duebox
from duebox.processes.liveness import free_names
from duebox.tables import attempt

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def pairs() -> Iterator[Callable[[bool], PgPair]]:
    """Start a primary and standby (synchronous or not); both are stopped,
    and their directory removed, at the end whatever happened."""
    why_not = available()
    if why_not is not None:
        if IN_CI:
            pytest.fail(f"PostgreSQL failover tests need their binaries under CI=true: {why_not}")
        pytest.skip(why_not)
    started: list[PgPair] = []

    def start(synchronous: bool) -> PgPair:
        pair = PgPair(free_port(), free_port(), synchronous=synchronous)
        started.append(pair)
        pair.start()
        return pair

    try:
        yield start
    finally:
        for pair in started:
            pair.stop()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path, LAUNCHER)
    try:
        yield p
    finally:
        p.stop_all()


def check_once_and_never_early(app: duebox.Duebox, ids: list[uuid.UUID]) -> None:
    """Each of these jobs succeeded with exactly one committed effect and
    one succeeded attempt, and no run of any job hit an effect already
    committed (a second effect would fail on the effects table's primary
    key); no effect started before its due time."""
    with app.engine.connect() as conn:
        done = set(conn.execute(sa.select(effects.c.job_id)).scalars())
        attempts = conn.execute(sa.select(attempt.c.job_id, attempt.c.outcome,
                                          attempt.c.error)).all()
    assert {str(i) for i in ids} <= done
    succeeded: dict[uuid.UUID, int] = {}
    for job_id, outcome, error in attempts:
        assert "duplicate key" not in (error or ""), (job_id, outcome, error)
        if outcome == "succeeded":
            succeeded[job_id] = succeeded.get(job_id, 0) + 1
    assert {i: succeeded.get(i, 0) for i in ids} == dict.fromkeys(ids, 1)
    check_no_early_start(app.engine)


def locks_free(app: duebox.Duebox, names: list[str]) -> set[str]:
    with app.engine.connect() as conn:
        return free_names(conn, names)


def broker_url(kind: str, request: pytest.FixtureRequest) -> str:
    if kind == "sql":
        return "sql://"
    keys: Keys = request.getfixturevalue("redis_keys")
    return keys.url()


def synchronous_pair(kind: str, pairs: Callable[[bool], PgPair], request: pytest.FixtureRequest
                     ) -> tuple[PgPair, str, duebox.Duebox]:
    """A synchronous pair, the broker of ``kind`` and the tests' app on them."""
    pair = pairs(True)
    broker = broker_url(kind, request)
    return pair, broker, prepare(pair, broker)


@pytest.mark.parametrize("kind", ["sql", "redis"])
def test_synchronous_failover_loses_nothing_and_the_same_processes_carry_on(
    kind: str, pairs: Callable[[bool], PgPair], procs: Procs, request: pytest.FixtureRequest
) -> None:
    pair, broker, app = synchronous_pair(kind, pairs, request)
    try:
        # The processes get libpq's host list; the test's own engine
        # SQLAlchemy's query form: both must reach the new primary.
        start_processes(app, procs, pair.multi_host_url(comma=True), broker, ["w1", "w2"])
        with Producer(app, seed=35) as producer:
            poll("some effects before the failover", answering(lambda: effects_count(app) >= 15),
                 timeout=30, check=procs.check)
            # w1 sleeps through the failover: on the new primary nobody holds
            # its liveness lock, so the relay takes it for dead.
            procs.signal("w1", signal.SIGSTOP)
            pair.kill_primary()
            pair.promote()
            promoted = time.monotonic()
            poll("the relay to take the paused worker for dead",
                 answering(lambda: "worker:w1-worker" not in registered(app)),
                 timeout=30, check=procs.check)
            procs.signal("w1", signal.SIGCONT)
            resumed_us = time.time_ns() // 1000
            poll("jobs scheduled after the promotion, and w1 back at work",
                 answering(lambda: producer.acked_after(promoted) >= 40
                           and effects_count(app, "w1-", resumed_us) > 0),
                 timeout=40, check=procs.check)
        # Nothing committed was lost; a commit that raised either happened
        # (and its job runs) or did not.
        ran = [*producer.ids(), *job_states(app.engine, producer.unsure)]
        poll("every acknowledged job to succeed",
             answering(lambda: all_succeeded(app.engine, ran)), timeout=40, check=procs.check)
        check_once_and_never_early(app, ran)
        # w1 holds its liveness lock on the new primary and is registered again.
        poll("w1 to register again", answering(lambda: "worker:w1-worker" in registered(app)),
             timeout=30, check=procs.check)
        procs.check()  # nobody exited: nothing was restarted
    finally:
        app.dispose()


# Long enough that "at once" and "a lease later" cannot be confused on a
# loaded machine: recovery could take the cut jobs back only this long after
# they started.
HELD_LEASE = 20.0


@pytest.mark.parametrize("kind", ["sql", "redis"])
def test_jobs_whose_transaction_the_failover_cut_run_again_at_once_not_a_lease_later(
    kind: str, pairs: Callable[[bool], PgPair], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pair, broker, app = synchronous_pair(kind, pairs, request)
    marks = tmp_path / "marks"
    marks.mkdir()
    procs = Procs(tmp_path, LAUNCHER, env={**os.environ, "DUEBOX_TEST_LEASE": f"{HELD_LEASE:g}"})
    try:
        start_processes(app, procs, pair.multi_host_url(comma=True), broker, ["w1", "w2"])
        # Six jobs for the workers' eight threads, each alone in its
        # transaction under a lease: three waiting in it until the primary
        # is dead (their completion meets the lost connection), three
        # querying through ctx.session (the handler meets it).
        with app.engine.begin() as conn:
            held = [app.schedule(conn, "held_effect",
                                 {"marks": str(marks), "hold": 15.0, "probe": n % 2 == 0})
                    for n in range(6)]
        poll("every held job to be inside its transaction",
             lambda: len(list(marks.iterdir())) == len(held), timeout=30, check=procs.check)
        killed_us = time.time_ns() // 1000
        pair.kill_primary()
        (marks / "killed").touch()
        pair.promote()
        poll("the cut jobs to run again and succeed",
             answering(lambda: all_succeeded(app.engine, held)), timeout=HELD_LEASE / 2,
             check=procs.check)
        check_once_and_never_early(app, held)
        # Each ran twice: a first attempt the worker itself settled as cut
        # (recovery's words would be "lease expired"), then one that
        # succeeded, started well within the first's lease.
        with app.engine.connect() as conn:
            attempts = conn.execute(
                sa.select(attempt.c.job_id, attempt.c.number, attempt.c.outcome, attempt.c.error)
                .where(attempt.c.job_id.in_(held)).order_by(attempt.c.number)).all()
        for job_id in held:
            mine = [(a.number, a.outcome) for a in attempts if a.job_id == job_id]
            assert mine == [(1, "lost"), (2, "succeeded")], (job_id, mine)
        errors = [a.error for a in attempts if a.outcome == "lost"]
        assert all(e.startswith("the job's transaction was cut") for e in errors), errors
        runs = effect_runs(app.engine)
        late = {i: (runs[str(i)][1] - killed_us) / 1e6 for i in held}
        assert max(late.values()) < HELD_LEASE / 2, late
        assert takeovers(procs) == 0, procs.log("r1")
    finally:
        procs.stop_all()
        app.dispose()


def test_asynchronous_failover_loses_what_the_standby_had_not_received(
    pairs: Callable[[bool], PgPair], procs: Procs
) -> None:
    pair = pairs(False)
    app = prepare(pair, "sql://")
    standby = sa.create_engine(pair.url(pair.ports[1]))
    try:
        start_processes(app, procs, pair.multi_host_url(comma=True), "sql://", ["w1"])
        with Producer(app, seed=36) as producer:
            poll("some effects", lambda: effects_count(app) >= 20, timeout=30,
                 check=procs.check)
            # Everything acknowledged before `replicated` is on the standby...
            replicated = time.monotonic()
            with app.engine.connect() as conn:
                lsn = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
            poll("the standby to receive it", lambda: _received(standby, lsn), timeout=30)
            # ...and nothing acknowledged after `cut`: the stream stops
            # while the primary goes on committing (asynchronous: it does
            # not wait for the standby).
            pair.pause_wal_sender()
            cut = time.monotonic()
            poll("jobs scheduled and run after the cut",
                 lambda: producer.acked_after(cut) >= 20, timeout=30, check=procs.check)
            killed = time.monotonic()
            pair.kill_primary()
            pair.promote()
            promoted = time.monotonic()
            poll("jobs scheduled after the promotion",
                 answering(lambda: producer.acked_after(promoted) >= 20),
                 timeout=40, check=procs.check)
        before, lost = producer.ids(before=replicated), producer.ids(after=cut, before=killed)
        after_promotion = producer.ids(after=promoted)
        # The RPO: every job acknowledged while the stream was stopped is
        # gone with the primary.
        assert lost
        assert job_states(app.engine, lost) == {}
        kept = [*before, *after_promotion]
        poll("every job the new primary has to succeed",
             answering(lambda: all_succeeded(app.engine, kept)), timeout=40, check=procs.check)
        check_once_and_never_early(app, kept)
        procs.check()
    finally:
        standby.dispose()
        app.dispose()


def _received(standby: sa.Engine, lsn: str) -> bool:
    with standby.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT pg_last_wal_receive_lsn() >= CAST(:lsn AS pg_lsn)"), {"lsn": lsn}).scalar())


def test_a_failover_whose_old_primary_does_not_answer_takes_nobody_for_dead(
    pairs: Callable[[bool], PgPair], procs: Procs
) -> None:
    """The old primary's host vanished without a word: every new
    connection to it waits for its connect timeout before the next host of
    the URL is tried — the liveness locks' connections 5 s.  The relay,
    which reaches the new primary before the workers lock again, must not
    take them for dead meanwhile (it waits AFTER_SERVER_CHANGE once it sees
    the server changed)."""
    pair = pairs(True)
    app = prepare(pair, "sql://")
    try:
        start_processes(app, procs, pair.multi_host_url(comma=True), "sql://", ["w1", "w2"])
        with Producer(app, seed=37) as producer:
            poll("some effects before the failover", answering(lambda: effects_count(app) >= 15),
                 timeout=30, check=procs.check)
            pair.kill_primary()
            with silent_host(pair.ports[0]):
                pair.promote()
                poll("both workers to hold their liveness locks on the new primary",
                     answering(lambda: locks_free(app, ["w1-worker", "w2-worker"]) == set()),
                     timeout=50, check=procs.check)
                # Long enough for any takeover already under way to show.
                locked = time.monotonic()
                poll("jobs scheduled since", answering(lambda: producer.acked_after(locked) >= 40),
                     timeout=40, check=procs.check)
            acked = producer.ids()
            poll("every acknowledged job to succeed",
                 answering(lambda: all_succeeded(app.engine, acked)), timeout=40,
                 check=procs.check)
        assert takeovers(procs) == 0, \
            procs.log("r1")
        check_once_and_never_early(app, acked)
    finally:
        app.dispose()
