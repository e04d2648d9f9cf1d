"""A PostgreSQL primary and its streaming standby, of one test's own.

Started from Debian's PostgreSQL binaries (``DUEBOX_PG_BIN``, default
``/usr/lib/postgresql/15/bin``) in a temporary directory, on free ports,
never touching the machine's shared server: ``initdb`` the primary,
``pg_basebackup -R`` the standby, both started with ``pg_ctl``.  Run as root,
every command runs as the ``postgres`` user (``initdb`` refuses root), and
the directory is that user's.

:meth:`PgPair.kill_primary` is the primary's machine dying: every process of
its cluster gets SIGKILL at once (the postmaster alone would leave its
backends serving until they notice); :meth:`PgPair.promote` is the
failover (``pg_ctl promote``).  :meth:`PgPair.stop` stops what is left and
removes the directory; callers run it in a ``finally``.

Used by tests/test_pg_failover.py and bench/pg_failover.py.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

PG_BIN = Path(os.environ.get("DUEBOX_PG_BIN", "/usr/lib/postgresql/15/bin"))
DATABASE = "duebox"


def available() -> str | None:
    """Why a pair cannot be started here (None: it can)."""
    missing = [b for b in ("initdb", "pg_ctl", "pg_basebackup", "postgres")
               if not (PG_BIN / b).exists()]
    if missing:
        return f"no PostgreSQL binaries {missing} under {PG_BIN} (set DUEBOX_PG_BIN)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to run initdb as"
    return None


class PgPair:
    """A primary on one free port and its standby on another."""

    def __init__(self, primary_port: int, standby_port: int, *, synchronous: bool) -> None:
        self.ports = (primary_port, standby_port)
        self.synchronous = synchronous
        self.root = Path(tempfile.mkdtemp(prefix="duebox-pgpair-"))
        self.primary = self.root / "primary"
        self.standby = self.root / "standby"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres"
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.root.chmod(0o700)

    # --- the commands, as the cluster's user --------------------------------

    def _run(self, *args: str, timeout: float = 60) -> str:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if self._user is not None:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        # Into a file, not a pipe: the server pg_ctl starts inherits its
        # output, and a pipe would not reach its end while the server runs.
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout, cwd=self.root, check=False)
            out.seek(0)
            said = out.read()
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{said[-3000:]}")
        return said

    def _append(self, conf: Path, lines: list[str]) -> None:
        with conf.open("a") as f:
            f.write("\n".join(lines) + "\n")

    # --- starting -------------------------------------------------------------

    def start(self) -> None:
        primary_port, standby_port = self.ports
        self._run("initdb", "-D", str(self.primary), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-sync", "--no-instructions")
        self._append(self.primary / "postgresql.conf", [
            "listen_addresses = '127.0.0.1'",
            f"port = {primary_port}",
            f"unix_socket_directories = '{self.root}'",
            "wal_level = replica", "max_wal_senders = 4", "wal_keep_size = '64MB'",
            "hot_standby = on", "max_connections = 150", "shared_buffers = '32MB'",
            # Only processes are killed here, never the machine: the page
            # cache survives, so nothing needs to reach the disk.
            "fsync = off",
        ])
        self._ctl_start(self.primary)
        self.sql(primary_port, f'CREATE DATABASE "{DATABASE}"')
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary_port), "-U", "postgres",
                  "-D", str(self.standby), "-R", "-X", "stream", "-c", "fast", "--no-sync")
        self._append(self.standby / "postgresql.auto.conf", [f"port = {standby_port}"])
        self._ctl_start(self.standby)
        if self.synchronous:
            # Only now: set before the standby streams, it would hold every
            # commit (CREATE DATABASE's too) until one does.  On the primary
            # only (postgresql.auto.conf, after the base backup), so the
            # promoted standby, alone, does not wait for a standby of its own.
            # '*': whichever standby is connected; there is one.
            self.sql(self.ports[0], "ALTER SYSTEM SET synchronous_standby_names = '*'",
                     "SELECT pg_reload_conf()")
        self.wait_streaming()

    def sql(self, port: int, *statements: str) -> None:
        """Run ``statements`` on one server, outside a transaction."""
        engine = sa.create_engine(self.url(port, dbname="postgres"),
                                  isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                for statement in statements:
                    conn.execute(sa.text(statement))
        finally:
            engine.dispose()

    def _ctl_start(self, data: Path) -> None:
        self._run("pg_ctl", "-D", str(data), "-l", str(data / "server.log"), "-w", "-t", "60",
                  "start")

    def wait_streaming(self, timeout: float = 60) -> None:
        """Until the primary sees its standby streaming (and, synchronous,
        as its synchronous standby: commits wait for it from then on)."""
        wanted = "sync" if self.synchronous else "async"
        engine = sa.create_engine(self.url(self.ports[0]))
        deadline = time.monotonic() + timeout
        try:
            while True:
                with engine.connect() as conn:
                    states = list(conn.execute(sa.text(
                        "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'"
                    )).scalars())
                if wanted in states:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the standby is not streaming ({states})")
                time.sleep(0.1)
        finally:
            engine.dispose()

    # --- addresses ------------------------------------------------------------

    @staticmethod
    def url(port: int, dbname: str = DATABASE) -> str:
        """One server's URL."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{port}/{dbname}"

    def multi_host_url(self, *, comma: bool = False) -> str:
        """Both servers, the one that takes writes chosen at each connect
        (libpq's ``target_session_attrs=read-write``).  ``comma``: libpq's
        ``h1:p1,h2:p2`` form; else SQLAlchemy's ``host=h1:p1&host=h2:p2``."""
        a, b = self.ports
        attrs = "target_session_attrs=read-write&connect_timeout=3"
        if comma:
            return f"postgresql+psycopg://postgres@127.0.0.1:{a},127.0.0.1:{b}/{DATABASE}?{attrs}"
        return (f"postgresql+psycopg://postgres@/{DATABASE}"
                f"?host=127.0.0.1:{a}&host=127.0.0.1:{b}&{attrs}")

    # --- the failover ---------------------------------------------------------

    def _processes(self, data: Path) -> list[int]:
        """The postmaster of ``data`` and its children."""
        try:
            postmaster = int((data / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return []
        # A postmaster.pid outlives a killed server: its pid may be another
        # process's by now.  Ours runs with ``-D <data>``.
        try:
            if str(data) not in Path(f"/proc/{postmaster}/cmdline").read_text():
                return []
        except OSError:
            return []
        if not _alive(postmaster):
            return []
        pids = [postmaster]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...: comm may hold spaces, so from the last ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                pids.append(int(entry.name))
        return pids

    def kill_primary(self) -> None:
        """SIGKILL every process of the primary's cluster, at once."""
        pids = self._processes(self.primary)
        assert pids, "the primary is not running"
        os.kill(pids[0], signal.SIGSTOP)  # no child forked between the list and the kill
        pids = self._processes(self.primary)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, "the primary's processes outlived SIGKILL"
            time.sleep(0.01)

    def promote(self) -> None:
        """The standby becomes the primary (``pg_ctl promote``, waited for)."""
        self._run("pg_ctl", "-D", str(self.standby), "-w", "-t", "60", "promote")

    def reopen_old_primary(self, port: int) -> str:
        """Start the killed primary's data again, alone, on ``port`` (never
        its own: the processes' multi-host URL names that one), to read what
        it had committed; its URL.  :meth:`stop` stops it."""
        assert not self._processes(self.primary), "the old primary still runs"
        (self.primary / "postmaster.pid").unlink(missing_ok=True)  # its pid may be another's now
        self._run("pg_ctl", "-D", str(self.primary), "-l", str(self.primary / "reopened.log"),
                  "-o", f"-p {port} -c synchronous_standby_names=''", "-w", "-t", "60",
                  "start")
        return self.url(port)

    def pause_wal_sender(self) -> None:
        """Stop the primary sending WAL to its standby (SIGSTOP on its WAL
        sender), while it goes on committing: whatever commits from now on
        is on the primary only.  (Pausing the standby's receiver instead
        would not: what the sender already wrote into the socket still
        arrives after the primary dies.)"""
        senders = [pid for pid in self._processes(self.primary)[1:]
                   if "walsender" in _cmdline(pid)]
        assert senders, "the primary has no WAL sender"
        for pid in senders:
            os.kill(pid, signal.SIGSTOP)

    def stop(self) -> None:
        """Stop both servers (immediately: nothing of theirs is kept) and
        remove the directory."""
        for data in (self.primary, self.standby):
            # Only a server that runs (a killed one leaves its postmaster.pid,
            # whose pid pg_ctl would signal even if another process has it now).
            running = self._processes(data)
            if running:
                for pid in running:  # a paused WAL sender included
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                with contextlib.suppress(Exception):
                    self._run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "-t", "30",
                              "stop")
            for pid in self._processes(data):  # whatever pg_ctl could not stop
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def silent_host(port: int) -> Iterator[None]:
    """Something on 127.0.0.1:``port`` that takes TCP connections and never
    answers: to a new connection, a machine that vanished without closing
    its sockets (powered off) — the connect waits for its timeout instead of
    being refused at once."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1024)
        yield


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie no longer serves anything
