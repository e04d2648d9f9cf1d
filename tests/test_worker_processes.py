"""``duebox worker --processes N`` (cli/supervisor.py, cli/child.py): a
supervisor and its worker processes, started through the command line as an
operator starts them and really killed, on PostgreSQL with ``sql://``, Redis
and RabbitMQ, a relay in the test's event loop.

The app (tests/apps/procs_app.py) appends a line to a file at every handler
call (outside any transaction) and writes one ``effects`` row per job in the
job's own transaction: "once" is checked on both.  Leases are 300 s, so a job
of a killed process that runs again within the tests' waits was handed on by
the liveness takeover (docs/design.md, "Liveness"), never by lease expiry.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import ROOT, free_port, with_params
from conftest import reset_tables
from helpers import Running, check_no_early_start, create_effects, effect_rows

import duebox
from duebox.tables import attempt, job, lease

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(420)]

APP = "tests.apps.procs_app:app"
# A child is a fresh interpreter importing duebox, SQLAlchemy, a driver and
# the app: seconds each on this shared machine, more under load.
UP = 90.0


# --- processes, as /proc shows them ---------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0].decode(), int(fields[1])


def alive(pid: int) -> bool:
    """Running, sleeping or stopped: not gone and not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None \
                and stat[1] == pid and stat[0] not in ("Z", "X"):
            found.append(int(name))
    return sorted(found)


class Supervised:
    """``duebox worker --processes N`` in a session of its own, output to a file."""

    def __init__(self, tmp: Path, database_url: str, broker_url: str, *, processes: int = 2,
                 concurrency: int = 2, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, name: str = "workers") -> None:
        self.calls = tmp / "calls.txt"
        self.log_path = tmp / f"{name}.log"
        self.run_dir = tmp / "run"  # TMPDIR: where its metrics directory goes
        self.run_dir.mkdir(exist_ok=True)
        environment = {k: v for k, v in os.environ.items() if not k.startswith("DUEBOX_")}
        environment.update({"DUEBOX_DATABASE_URL": database_url, "DUEBOX_BROKER_URL": broker_url,
                            "PROCS_CALLS": str(self.calls), "TMPDIR": str(self.run_dir),
                            **(env or {})})
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "duebox", "worker", "--app", APP,
                 f"--processes={processes}", f"--concurrency={concurrency}", *args],
                cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.pid = self.proc.pid
        self.exit_expected = False
        self.seen: set[int] = set()  # every child pid seen, for the cleanup

    def children(self) -> list[int]:
        found = children(self.pid)
        self.seen.update(found)
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check(self) -> None:
        if not self.exit_expected and self.proc.poll() is not None:
            raise AssertionError(f"the supervisor exited with {self.proc.returncode}:\n"
                                 f"{self.log()[-6000:]}")

    def signal(self, sig: signal.Signals) -> None:
        self.exit_expected = True
        os.kill(self.pid, sig)

    def stop(self) -> int:
        self.signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)

    def cleanup(self) -> None:
        """Nothing left running, whatever the test did (each by its own pid)."""
        if self.proc.poll() is None:
            self.children()
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.seen:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def fleets() -> Iterator[list[Supervised]]:
    started: list[Supervised] = []
    yield started
    for s in started:
        s.cleanup()


# --- the database, the broker and the test's side of the app ------------------------------


@pytest.fixture
def pg(pg_server_url: str) -> str:
    reset_tables(pg_server_url)
    return pg_server_url


def _broker(request: pytest.FixtureRequest) -> str:
    if request.param == "sql":
        return "sql://"
    if request.param == "redis":
        return str(request.getfixturevalue("redis_keys").url())
    vhost: str = request.getfixturevalue("amqp_vhost")
    return with_params(vhost, prefix=f"p{uuid.uuid4().hex[:8]}")


@pytest.fixture(params=["sql", "redis", "amqp"])
def broker_url(request: pytest.FixtureRequest) -> str:
    return _broker(request)


@pytest.fixture(params=["sql", "redis"])
def kill_broker_url(request: pytest.FixtureRequest) -> str:
    """The crash tests: the table as the queue, and a broker that holds
    messages a dead consumer had received (Redis: the relay hands them on)."""
    return _broker(request)


def producer(database_url: str, broker_url: str) -> duebox.Duebox:
    """The test's own app: it schedules, and its relay publishes and
    recovers; the handlers run only in the worker processes."""
    app = duebox.Duebox(database_url, broker_url, settings=duebox.Settings(
        lease_seconds=300, poll_interval=0.05, clock_skew_margin=0.2, batch_size=50))

    @app.task("procs.effect", max_attempts=5)
    def effect(payload: Any, ctx: duebox.JobContext) -> None:  # pragma: no cover
        raise AssertionError("runs in the worker processes")

    create_effects(app.engine)
    return app


def schedule(app: duebox.Duebox, n: int, *, seconds: float = 0.0,
             spread: float = 0.0) -> list[uuid.UUID]:
    """``n`` jobs whose handlers take ``seconds``, due over the next ``spread`` s."""
    with app.engine.begin() as conn:
        jobs = [app.new_job("procs.effect", {"seconds": seconds},
                            delay=timedelta(seconds=spread * i / max(1, n - 1)))
                for i in range(n)]
        ids = app.schedule_many(conn, jobs)
    assert isinstance(ids, list)
    return ids


def states(app: duebox.Duebox) -> Counter[str]:
    with app.engine.connect() as conn:
        return Counter(dict(conn.execute(
            sa.select(job.c.state, sa.func.count()).group_by(job.c.state)).all()))


def running_owners(app: duebox.Duebox) -> list[str]:
    with app.engine.connect() as conn:
        return list(conn.execute(sa.select(job.c.lease_owner)
                                 .where(job.c.state == "RUNNING")).scalars())


def registered_workers(app: duebox.Duebox) -> list[str]:
    with app.engine.connect() as conn:
        return list(conn.execute(sa.select(lease.c.name)
                                 .where(lease.c.name.like("worker:%"))).scalars())


def of(pid: int, names: list[str]) -> list[str]:
    """The worker names (or lease owners) of the process ``pid``: its
    generated name is ``worker:<host>:<pid>:<random>``."""
    return [n for n in names if n.split(":")[2:3] == [str(pid)]]


def up(fleet: Supervised, app: duebox.Duebox, n: int) -> list[int] | None:
    """The supervisor's children if there are ``n``, each a registered worker
    that has logged its start (it consumes from then on); else None. Raises
    if the supervisor exited."""
    fleet.check()
    kids, names = fleet.children(), registered_workers(app)
    started = [line for line in fleet.log().splitlines() if " started: queues " in line]
    return kids if len(kids) == n and all(
        of(pid, names) and any(f":{pid}:" in line for line in started) for pid in kids) \
        else None


def _poll(predicate: Any, timeout: float, what: str, fleet: Supervised | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if fleet is not None:
            fleet.check()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                                 + (f":\n{fleet.log()[-4000:]}" if fleet else ""))
        time.sleep(0.05)


def calls(fleet: Supervised) -> Counter[str]:
    """Handler calls per job id, committed or not."""
    if not fleet.calls.exists():
        return Counter()
    return Counter(line.split()[0] for line in fleet.calls.read_text().splitlines())


def callers(fleet: Supervised) -> set[int]:
    if not fleet.calls.exists():
        return set()
    return {int(line.split()[1]) for line in fleet.calls.read_text().splitlines()}


def attempt_rows(app: duebox.Duebox) -> list[tuple[str, str | None, str]]:
    """(job id, outcome, worker) of every attempt, in order."""
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(attempt.c.job_id, attempt.c.outcome, attempt.c.worker)
                            .order_by(attempt.c.number)).all()
    return [(str(j), o, w) for j, o, w in rows]


def outcomes(app: duebox.Duebox) -> dict[str, list[str | None]]:
    out: dict[str, list[str | None]] = {}
    for job_id, outcome, _ in attempt_rows(app):
        out.setdefault(job_id, []).append(outcome)
    return out


# --- the guarantees, across processes -------------------------------------------------------


@contextlib.asynccontextmanager
async def scene(database_url: str, broker_url: str, tmp: Path, fleets: list[Supervised],
                processes: int = 2, args: tuple[str, ...] = ()
                ) -> AsyncIterator[tuple[duebox.Duebox, Supervised, Running, list[int]]]:
    """The test's app and relay, and a supervisor whose ``processes`` children
    are up (their pids)."""
    app = producer(database_url, broker_url)
    fleet = Supervised(tmp, database_url, broker_url, processes=processes, args=args)
    fleets.append(fleet)
    try:
        async with Running(app, workers=0) as relay:
            kids = await relay.wait(lambda: up(fleet, app, processes), timeout=UP,
                                    what="the worker processes")
            yield app, fleet, relay, kids
    finally:
        app.dispose()


async def running_in_each(relay: Running, app: duebox.Duebox, kids: list[int]) -> None:
    await relay.wait(lambda: all(of(p, running_owners(app)) for p in kids), timeout=60,
                     what="a job running in each worker process")


async def test_jobs_run_once_across_the_processes_and_none_early(
        pg: str, broker_url: str, tmp_path: Path, fleets: list[Supervised]) -> None:
    await _once_and_never_early(pg, broker_url, tmp_path, fleets)


async def test_on_a_sqlite_file_too(tmp_path: Path, fleets: list[Supervised]) -> None:
    """The embedded default (``sqlite:///duebox.db``, ``sql://``) under the
    new default of one process per CPU: writers in several processes."""
    url = f"sqlite:///{tmp_path}/duebox.db"
    reset_tables(url)
    await _once_and_never_early(url, "sql://", tmp_path, fleets)


async def _once_and_never_early(database_url: str, broker_url: str, tmp_path: Path,
                                fleets: list[Supervised]) -> None:
    async with scene(database_url, broker_url, tmp_path, fleets) as (app, fleet, relay, kids):
        ids = schedule(app, 120, seconds=0.02, spread=3.0)
        await relay.wait(lambda: states(app)["SUCCEEDED"] == len(ids), timeout=120,
                         what="every job to succeed")
        assert fleet.stop() == 0, fleet.log()
        assert {str(i) for i in ids} == set(effect_rows(app.engine))
        assert set(calls(fleet).values()) == {1}, "a handler ran twice"
        assert callers(fleet) == set(kids), "both processes ran jobs"
        check_no_early_start(app.engine)
        assert not any(alive(p) for p in kids)


async def test_a_killed_child_is_restarted_and_its_jobs_run_again_in_seconds(
        pg: str, kill_broker_url: str, tmp_path: Path, fleets: list[Supervised]) -> None:
    async with scene(pg, kill_broker_url, tmp_path, fleets) as (app, fleet, relay, kids):
        ids = schedule(app, 8, seconds=3.0)
        # Whichever took them: a Redis read can take all 8.
        first = await relay.wait(
            lambda: next((p for p in kids if of(p, running_owners(app))), None),
            timeout=60, what="a job running in a worker process")
        os.kill(first, signal.SIGKILL)
        # Read at once: the relay hands them on only after two looks 1 s apart.
        doomed = {str(r) for r in _running_jobs(app, first)}
        assert doomed
        # Its replacement: a new process in the slot, registered under a new name.
        await relay.wait(lambda: (now := up(fleet, app, 2)) and first not in now,
                         timeout=UP, what="the supervisor to start another worker process")
        await relay.wait(lambda: states(app)["SUCCEEDED"] == len(ids), timeout=90,
                         what="every job to succeed, the killed process's taken over")
        assert fleet.stop() == 0, fleet.log()
        assert f"(pid {first}) was killed by SIGKILL" in fleet.log()
        assert {str(i) for i in ids} == set(effect_rows(app.engine))  # once in effect
        # Lost: exactly the killed process's attempts (those running when it
        # died, and any whose start it had sent the database just then).
        lost = {job_id: worker for job_id, outcome, worker in attempt_rows(app)
                if outcome == "lost"}
        assert doomed <= set(lost), (doomed, lost)
        assert all(of(first, [w]) for w in lost.values()), lost
        attempts = outcomes(app)
        for job_id in ids:
            expected = ["lost", "succeeded"] if str(job_id) in lost else ["succeeded"]
            assert attempts[str(job_id)] == expected, (job_id, attempts[str(job_id)])


async def run_the_rest(relay: Running, app: duebox.Duebox, fleets: list[Supervised],
                       ids: list[uuid.UUID], again: Supervised) -> None:
    """``again``, a new supervisor, runs what is left: every job succeeds,
    each exactly once in effect."""
    fleets.append(again)
    await relay.wait(lambda: states(app)["SUCCEEDED"] == len(ids), timeout=UP + 60,
                     what="every job to succeed in the new worker processes")
    assert again.stop() == 0, again.log()
    assert {str(i) for i in ids} == set(effect_rows(app.engine))


def _running_jobs(app: duebox.Duebox, pid: int) -> list[uuid.UUID]:
    with app.engine.connect() as conn:
        rows = conn.execute(sa.select(job.c.id, job.c.lease_owner)
                            .where(job.c.state == "RUNNING")).all()
    return [r.id for r in rows if of(pid, [r.lease_owner])]


async def test_a_killed_supervisor_leaves_no_child_and_its_jobs_run_again(
        pg: str, kill_broker_url: str, tmp_path: Path, fleets: list[Supervised]) -> None:
    async with scene(pg, kill_broker_url, tmp_path, fleets) as (app, fleet, relay, kids):
        # More than one process takes in hand (a Redis read takes up to 8).
        ids = schedule(app, 20, seconds=3.0)
        await running_in_each(relay, app, kids)
        fleet.signal(signal.SIGKILL)  # the OOM killer, or `kill -9` of the pid one sees
        fleet.proc.wait(10)
        await relay.wait(lambda: not any(alive(p) for p in kids), timeout=10,
                         what="the worker processes to die with their supervisor")
        await run_the_rest(relay, app, fleets, ids, Supervised(
            tmp_path, pg, kill_broker_url, processes=1, name="again"))
        lost = [j for j, o in outcomes(app).items() if o == ["lost", "succeeded"]]
        assert len(lost) >= 2, outcomes(app)  # at least one running in each killed process


async def test_sigterm_drains_every_process_nothing_lost_or_run_twice(
        pg: str, kill_broker_url: str, tmp_path: Path, fleets: list[Supervised]) -> None:
    async with scene(pg, kill_broker_url, tmp_path, fleets) as (app, fleet, relay, kids):
        ids = schedule(app, 30, seconds=1.0)
        await running_in_each(relay, app, kids)
        assert fleet.stop() == 0, fleet.log()
        assert not any(alive(p) for p in kids)
        after_stop = states(app)
        ran = set(effect_rows(app.engine))
        # Every handler that had started finished: nothing was cut short.
        assert all(o == ["succeeded"] for o in outcomes(app).values()), outcomes(app)
        assert set(calls(fleet)) == ran
        assert after_stop["SUCCEEDED"] == len(ran)
        assert after_stop["RUNNING"] == 0, after_stop  # handed back, not left to leases
        assert len(ran) < len(ids), "the stop came after the work: it tested nothing"
        await run_the_rest(relay, app, fleets, ids, Supervised(
            tmp_path, pg, kill_broker_url, processes=2, name="again"))
        assert set(calls(fleet).values()) == {1}, "a handler ran twice"  # one calls file
        supervisor_lines = [ln for ln in fleet.log().splitlines() if "duebox.supervisor" in ln]
        assert [" started 2 worker processes" in ln for ln in supervisor_lines] == \
            [True, False, False], supervisor_lines  # started, stopping, stopped: nothing else


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_stop_signal_kills_the_processes_and_their_jobs_run_again(
        pg: str, tmp_path: Path, fleets: list[Supervised], sig: signal.Signals) -> None:
    """The first signal waits as long as the handlers take (here 120 s), the
    jobs not started given back; the second kills the children and exits 1."""
    async with scene(pg, "sql://", tmp_path, fleets) as (app, fleet, relay, kids):
        ids = schedule(app, 8, seconds=120.0)  # more than one process claims
        await running_in_each(relay, app, kids)
        fleet.signal(sig)
        await relay.wait(lambda: "stopping (" in fleet.log(), timeout=30,
                         what="the supervisor to pass the stop on")
        # Draining: the handlers still run, and the processes wait for them.
        assert fleet.proc.poll() is None
        assert all(alive(p) for p in kids)
        now = states(app)
        assert now["RUNNING"] >= 2, now
        assert now["SUCCEEDED"] == 0, now
        fleet.signal(sig)
        assert fleet.proc.wait(timeout=60) == 1
        assert not any(alive(p) for p in kids)
        assert "killed 2 worker processes" in fleet.log()
        await relay.wait(lambda: states(app)["SCHEDULED"] == len(ids), timeout=30,
                         what="the relay to take the killed processes' jobs back")
        assert all(o == ["lost"] for o in outcomes(app).values()), outcomes(app)
        assert not effect_rows(app.engine)


async def test_a_paused_supervisor_restarts_a_child_that_died_meanwhile(
        pg: str, tmp_path: Path, fleets: list[Supervised]) -> None:
    """SIGSTOP the supervisor, kill a child, SIGCONT: the signals it could not
    act on while stopped are acted on once it runs (its children never
    stopped: a pause of the whole worker is a pause of the process group)."""
    async with scene(pg, "sql://", tmp_path, fleets) as (app, fleet, relay, kids):
        ids = schedule(app, 12, seconds=1.0)
        os.kill(fleet.pid, signal.SIGSTOP)
        await relay.wait(lambda: (_stat(fleet.pid) or ("?", 0))[0] == "T", timeout=10,
                         what="the supervisor to stop")
        os.kill(kids[0], signal.SIGKILL)
        await relay.wait(lambda: effect_rows(app.engine), timeout=60,
                         what="the other child to go on working meanwhile")
        assert fleet.children() == [kids[1]]
        os.kill(fleet.pid, signal.SIGCONT)
        await relay.wait(lambda: (now := up(fleet, app, 2)) and kids[0] not in now,
                         timeout=UP, what="the resumed supervisor to start another")
        await relay.wait(lambda: states(app)["SUCCEEDED"] == len(ids), timeout=90,
                         what="every job to succeed")
        assert fleet.stop() == 0, fleet.log()
        assert {str(i) for i in ids} == set(effect_rows(app.engine))


# --- metrics -----------------------------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


SUCCEEDED = 'duebox_jobs_succeeded_total{backend="sql",queue="default"}'


async def test_the_metrics_endpoint_serves_the_sums_of_every_process(
        pg: str, tmp_path: Path, fleets: list[Supervised]) -> None:
    port = free_port()
    async with scene(pg, "sql://", tmp_path, fleets,
                     args=(f"--metrics-port={port}",)) as (app, fleet, relay, kids):
        ids = schedule(app, 60, seconds=0.05)
        await relay.wait(lambda: states(app)["SUCCEEDED"] == len(ids), timeout=120,
                         what="every job to succeed")
        assert callers(fleet) == set(kids), "both processes ran jobs: the sum adds two"
        counts = Counter(int(line.split()[1]) for line in fleet.calls.read_text().splitlines())
        per_child = sorted(counts.values())
        assert sum(per_child) == len(ids), per_child
        # A child counts a success after its transaction commits, so the
        # database can show the last ones SUCCEEDED a moment before the
        # counters do: wait for the sum to arrive, then hold it to exactly 60.
        await relay.wait(lambda: scrape(port).get(SUCCEEDED, 0.0) >= len(ids), timeout=30,
                         what="the last successes to be counted")
        assert scrape(port)[SUCCEEDED] == len(ids), per_child
        # A child that dies takes its gauges with it, not its counters.
        (directory,) = fleet.run_dir.glob("duebox-metrics-*")
        assert (directory / f"gauge_livemax_{kids[0]}.db").exists()
        os.kill(kids[0], signal.SIGKILL)
        await relay.wait(lambda: scrape(port).get("duebox_worker_process_restarts_total"),
                         timeout=30, what="the supervisor to start another process")
        assert scrape(port)[SUCCEEDED] == len(ids), "a dead process's counters stay in the sums"
        assert not (directory / f"gauge_livemax_{kids[0]}.db").exists()
        kids = await relay.wait(lambda: up(fleet, app, 2), timeout=UP, what="the new one")
        assert scrape(port)["duebox_worker_processes"] == 2
        # A supervisor killed outright leaves its directory; the next run
        # neither adds it in nor keeps it.
        fleet.signal(signal.SIGKILL)
        fleet.proc.wait(10)
        await relay.wait(lambda: not any(alive(p) for p in kids), timeout=10,
                         what="the children to die with their supervisor")
        assert directory.exists()
        port2 = free_port()
        again = Supervised(tmp_path, pg, "sql://", processes=2, name="again",
                           args=(f"--metrics-port={port2}",))
        fleets.append(again)
        await relay.wait(lambda: up(again, app, 2), timeout=UP, what="the new workers")
        assert scrape(port2).get(SUCCEEDED, 0.0) == 0.0, "the killed run's counters were added"
        assert not directory.exists(), "the killed run's directory is still there"
        assert again.stop() == 0, again.log()
        assert not list(again.run_dir.glob("duebox-metrics-*")), "removed at exit"


# --- start-up failures ------------------------------------------------------------------


@pytest.mark.parametrize(("fail", "last_line", "restarts"), [
    # A configuration error would come back at every start: stop at once.
    ("config", "ConfigurationError: procs_app: refused in the child, as the test asked", 0),
    # Anything else is tried again, with a growing backoff, up to 5 times.
    ("crash", "the 5th time in a row within 30 s of its start", 4),
])
def test_a_child_that_cannot_start_stops_the_supervisor_with_its_error(
        pg: str, tmp_path: Path, fleets: list[Supervised], fail: str, last_line: str,
        restarts: int) -> None:
    """The supervisor imported the app itself first; the children cannot."""
    fleet = Supervised(tmp_path, pg, "sql://", processes=2, env={"PROCS_FAIL_IN_CHILD": fail})
    fleets.append(fleet)
    fleet.exit_expected = True
    assert fleet.proc.wait(timeout=UP * 5) == 1
    log = fleet.log()
    assert log.splitlines()[-1].startswith("Error: "), log
    assert last_line in log.splitlines()[-1], log
    assert log.count("starting another in") >= restarts, log
    if not restarts:
        assert "starting another in" not in log, log
    assert not children(fleet.pid)


def test_one_process_is_the_worker_itself_with_no_supervisor(
        pg: str, tmp_path: Path, fleets: list[Supervised]) -> None:
    app = producer(pg, "sql://")
    fleet = Supervised(tmp_path, pg, "sql://", processes=1)
    fleets.append(fleet)
    _poll(lambda: of(fleet.pid, registered_workers(app)), UP, "the worker to register", fleet)
    assert fleet.children() == []
    assert alive(fleet.pid)
    assert fleet.stop() == 0, fleet.log()
    assert "duebox.supervisor" not in fleet.log()
    app.dispose()


# --- dying with the parent, with and without the kernel's help --------------------------------

# The parent: starts a grandchild that arms die_with_parent, reports its pid,
# and sleeps until killed.
_PARENT = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), *sys.argv[2:]])
print(child.pid, flush=True)
child.wait()
"""
_ARMED = """
import os, sys, time
from duebox.cli.child import die_with_parent
parent, go, use_prctl = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "prctl"
while not os.path.exists(go):  # the test may kill the parent first
    time.sleep(0.01)
die_with_parent(parent, use_prctl=use_prctl)
open(go + ".armed", "w").close()
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["prctl", "watch"])
@pytest.mark.parametrize("parent_dies", ["after", "before"])
def test_a_child_dies_with_its_parent(tmp_path: Path, how: str, parent_dies: str) -> None:
    """``after``: the parent is SIGKILLed once the child armed itself;
    ``before``: between the child's start and its arming (the race the
    parent-pid check after the prctl closes)."""
    go = tmp_path / "go"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _ARMED, str(go), how],
                              stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True)
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    try:
        if parent_dies == "after":
            go.touch()
            _poll(lambda: (tmp_path / "go.armed").exists(), 60, "the child to arm")
            assert alive(grandchild)
        parent.kill()
        parent.wait(10)
        if parent_dies == "before":
            go.touch()
        _poll(lambda: not alive(grandchild), 10, "the child to die with its parent")
    finally:
        parent.stdout.close()
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
