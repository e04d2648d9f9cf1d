"""A Kafka-protocol broker for the tests: librdkafka's built-in mock cluster.

No Apache Kafka package can be installed on the test machines, but the
librdkafka shipped inside the ``confluent-kafka`` wheel contains a mock
cluster that speaks the Kafka protocol (produce, fetch, consumer groups,
offset commits, idempotent producers).  This script starts one through
librdkafka's C API (ctypes) and keeps it alive until SIGTERM/SIGINT::

    python tests/services/kafka_mock.py start    # detached; pid file in tests/services/.run
    python tests/services/kafka_mock.py stop
    python tests/services/kafka_mock.py restart  # SIGKILL, then a new (empty) cluster
    python tests/services/kafka_mock.py run [--port 19092] [--pidfile PATH]  # foreground

``run`` prints ``ready 127.0.0.1:PORT`` once clients can connect.  The mock's own
listener takes a random port, so a small TCP relay listens on the fixed
``--port`` and the broker advertises that address in its metadata: a client
given ``kafka://127.0.0.1:PORT`` keeps working when this process is killed
and started again (as a *new, empty* cluster: the mock keeps everything in
memory, so a restart is a broker that lost its disk — harsher than a real
Kafka restart, which keeps its log).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import glob
import os
import signal
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CHUNK = 1 << 16


def _librdkafka() -> Any:
    import confluent_kafka

    here = Path(confluent_kafka.__file__).resolve().parent
    found = sorted(glob.glob(str(here.parent / "confluent_kafka.libs" / "librdkafka*.so*")))
    if not found:  # a confluent-kafka linked against the system's librdkafka
        found = ["librdkafka.so.1"]
    lib = ctypes.CDLL(found[0])
    vp, cp = ctypes.c_void_p, ctypes.c_char_p
    lib.rd_kafka_conf_new.restype = vp
    lib.rd_kafka_conf_set.argtypes = [vp, cp, cp, cp, ctypes.c_size_t]
    lib.rd_kafka_new.restype = vp
    lib.rd_kafka_new.argtypes = [ctypes.c_int, vp, cp, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [vp]
    lib.rd_kafka_mock_cluster_new.restype = vp
    lib.rd_kafka_mock_cluster_new.argtypes = [vp, ctypes.c_int]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [vp]
    lib.rd_kafka_mock_cluster_bootstraps.restype = cp
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [vp]
    lib.rd_kafka_mock_broker_set_host_port.argtypes = [vp, ctypes.c_int32, cp, ctypes.c_int]
    lib.rd_kafka_mock_set_controller_id.argtypes = [vp, ctypes.c_int32]
    lib.rd_kafka_mock_group_initial_rebalance_delay_ms.argtypes = [vp, ctypes.c_int32]
    return lib


class MockCluster:
    """One mock broker (id 1) advertised at ``127.0.0.1:port``."""

    def __init__(self, port: int) -> None:
        self.lib = lib = _librdkafka()
        conf = lib.rd_kafka_conf_new()
        err = ctypes.create_string_buffer(512)
        settings = [("log_level", "3"), ("client.id", "duebox-kafka-mock")]
        if os.environ.get("KAFKA_MOCK_DEBUG"):  # e.g. "mock,cgrp": the group's state machine
            settings += [("log_level", "7"), ("debug", os.environ["KAFKA_MOCK_DEBUG"])]
        for key, value in settings:
            lib.rd_kafka_conf_set(conf, key.encode(), value.encode(), err, len(err))
        self.rk = lib.rd_kafka_new(0, conf, err, len(err))  # 0: a producer handle
        if not self.rk:
            raise RuntimeError(f"rd_kafka_new failed: {err.value.decode()}")
        self.cluster = lib.rd_kafka_mock_cluster_new(self.rk, 1)
        if not self.cluster:
            raise RuntimeError("rd_kafka_mock_cluster_new failed")
        host, _, real = lib.rd_kafka_mock_cluster_bootstraps(self.cluster).decode().partition(":")
        self.real = (host, int(real))
        self.port = port
        # Admin requests (CreateTopics) go to the controller: make it the broker.
        lib.rd_kafka_mock_set_controller_id(self.cluster, 1)
        lib.rd_kafka_mock_broker_set_host_port(self.cluster, 1, b"127.0.0.1", port)
        # Kafka's group.initial.rebalance.delay.ms is 3 s; tests start many
        # short-lived groups, so the first rebalance happens at once here.
        lib.rd_kafka_mock_group_initial_rebalance_delay_ms(self.cluster, 0)

    def close(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self.cluster)
        self.lib.rd_kafka_destroy(self.rk)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


# --- SyncGroup as Kafka answers it ------------------------------------------------------
#
# The mock goes from Syncing to Up as soon as the *leader's* SyncGroup has set
# an assignment for every member (rdkafka_mock_cgrp.c counts assignments, not
# members that synced), and then answers a follower's SyncGroup that arrives
# after the leader's with INVALID_REQUEST (rd_kafka_mock_cgrp_check_state: no
# SyncGroup in state Up).  A Kafka broker answers it with the follower's
# assignment.  aiokafka takes INVALID_REQUEST as fatal and raises it to the
# application, whose consumer then leaves and joins again: another rebalance,
# where the next late follower fails the same way.  With --fix-sync-group the
# relay remembers the assignments of each group's last leader SyncGroup and
# turns such an INVALID_REQUEST into that answer.

_SYNC_GROUP = 14
_INVALID_REQUEST = 42


def _string(buf: bytes, pos: int) -> tuple[str | None, int]:
    n = struct.unpack_from(">h", buf, pos)[0]
    if n < 0:
        return None, pos + 2
    return buf[pos + 2:pos + 2 + n].decode(), pos + 2 + n


class SyncGroups:
    """Assignments from leaders' SyncGroup requests (v0-v3), and the
    SyncGroup requests each connection has in flight."""

    def __init__(self) -> None:
        # group -> (generation, member -> assignment)
        self.latest: dict[str, tuple[int, dict[str, bytes]]] = {}
        self.rewritten = 0

    def request(self, frame: bytes, in_flight: dict[int, tuple[int, str, int, str]]) -> None:
        api_key, version, correlation = struct.unpack_from(">hhi", frame, 0)
        if api_key != _SYNC_GROUP or version > 3:
            return
        _, pos = _string(frame, 8)  # client id
        group, pos = _string(frame, pos)
        (generation,) = struct.unpack_from(">i", frame, pos)
        member, pos = _string(frame, pos + 4)
        if version >= 3:
            _, pos = _string(frame, pos)  # group instance id
        (count,) = struct.unpack_from(">i", frame, pos)
        pos += 4
        assignments: dict[str, bytes] = {}
        for _ in range(max(count, 0)):
            who, pos = _string(frame, pos)
            (size,) = struct.unpack_from(">i", frame, pos)
            assignments[who or ""] = frame[pos + 4:pos + 4 + max(size, 0)]
            pos += 4 + max(size, 0)
        if assignments and group is not None:
            self.latest[group] = (generation, assignments)
        if group is not None and member is not None:
            in_flight[correlation] = (version, group, generation, member)

    def response(self, frame: bytes, in_flight: dict[int, tuple[int, str, int, str]]) -> bytes:
        (correlation,) = struct.unpack_from(">i", frame, 0)
        sent = in_flight.pop(correlation, None)
        if sent is None:
            return frame
        version, group, generation, member = sent
        at = 8 if version >= 1 else 4  # after the throttle time
        (error,) = struct.unpack_from(">h", frame, at)
        known = self.latest.get(group)
        if error != _INVALID_REQUEST or known is None or known[0] != generation \
                or member not in known[1]:
            return frame
        self.rewritten += 1
        assignment = known[1][member]
        return frame[:at] + struct.pack(">hi", 0, len(assignment)) + assignment


async def _frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  each: Callable[[bytes], bytes | None]) -> None:
    """Like _pump, one Kafka frame (size-prefixed) at a time."""
    try:
        while True:
            head = await reader.readexactly(4)
            frame = await reader.readexactly(struct.unpack(">i", head)[0])
            out = each(frame)
            if out is not None and out is not frame:
                frame, head = out, struct.pack(">i", len(out))
            writer.write(head + frame)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(port: int, pidfile: str | None, fix_sync_group: bool = False) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    holder: dict[str, MockCluster] = {}
    syncs = SyncGroups()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, real = holder["mock"].real
        try:
            up_r, up_w = await asyncio.open_connection(host, real)
        except OSError:
            writer.close()
            return
        if not fix_sync_group:
            await asyncio.gather(_pump(reader, up_w), _pump(up_r, writer))
            return
        in_flight: dict[int, tuple[int, str, int, str]] = {}

        def request(frame: bytes) -> None:
            with contextlib.suppress(struct.error, UnicodeDecodeError):
                syncs.request(frame, in_flight)

        def response(frame: bytes) -> bytes:
            try:
                return syncs.response(frame, in_flight)
            except (struct.error, UnicodeDecodeError):
                return frame

        await asyncio.gather(_frames(reader, up_w, request), _frames(up_r, writer, response))

    server = await asyncio.start_server(relay, "127.0.0.1", port, reuse_address=True)
    port = server.sockets[0].getsockname()[1]
    holder["mock"] = mock = MockCluster(port)
    if pidfile:
        Path(pidfile).write_text(f"{os.getpid()}\n")  # noqa: ASYNC240 - once, at start
    print(f"ready 127.0.0.1:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        server.close()
        mock.close()
        if fix_sync_group:
            print(f"late SyncGroups answered with their assignment: {syncs.rewritten}",
                  flush=True)
        if pidfile:
            Path(pidfile).unlink(missing_ok=True)  # noqa: ASYNC240 - once, at exit


RUN = Path(__file__).resolve().parent / ".run"


def pidfile_for(port: int) -> Path:
    """Where the mock on ``port`` keeps its process id (and log): one per
    port, so mocks of two test sessions never stop each other."""
    return RUN / f"kafka-mock-{port}.pid"


def start_background(port: int, *, pidfile: Path | None = None, timeout: float = 30.0,
                     fix_sync_group: bool = False) -> str:
    """Start this script detached; return ``host:port`` once it is ready."""
    import shlex
    import subprocess
    import time

    pidfile = pidfile or pidfile_for(port)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    log = pidfile.with_suffix(".log")
    log.write_text("")
    # Detached through a shell that exits at once: the mock is nobody's child
    # here, so no Popen object is left to be collected while it runs.
    command = " ".join(shlex.quote(a) for a in (
        sys.executable, __file__, "run", "--port", str(port), "--pidfile", str(pidfile),
        *(["--fix-sync-group"] if fix_sync_group else [])))
    subprocess.run(["sh", "-c", f"nohup setsid {command} >{shlex.quote(str(log))} 2>&1 "
                    "</dev/null &"], check=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        for line in text.splitlines():
            if line.startswith("ready "):
                return line.split()[1]
        if "Traceback" in text or "Error" in text:
            raise RuntimeError(f"the Kafka mock did not start:\n{text}")
        time.sleep(0.05)
    stop_background(pidfile, signal.SIGKILL)
    raise RuntimeError(f"the Kafka mock did not start within {timeout:g} s")


def stop_background(pidfile: Path, sig: int = signal.SIGTERM) -> bool:
    """Stop the process named in ``pidfile``; False if none was running."""
    import time

    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pidfile.unlink(missing_ok=True)
        return False
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    if sig != signal.SIGKILL:  # stopped for good (a kill is a restart's first half)
        pidfile.with_suffix(".log").unlink(missing_ok=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description="librdkafka's mock Kafka cluster at a fixed address, for duebox's tests.")
    parser.add_argument("command", nargs="?", default="run",
                        choices=["run", "start", "stop", "restart"],
                        help="run: in the foreground; start: detached, returns when ready "
                             "(pid file in tests/services/.run, per port); stop; restart: SIGKILL, "
                             "then start an empty cluster at the same address")
    parser.add_argument("--port", type=int, default=19092,
                        help="the fixed port clients use (0: any free port with run)")
    parser.add_argument("--pidfile", help="run: write this process's id here while it runs")
    parser.add_argument("--fix-sync-group", action="store_true",
                        help="answer a follower's late SyncGroup with its assignment, as "
                             "Kafka does, instead of the mock's INVALID_REQUEST")
    args = parser.parse_args()
    if args.command == "run":
        asyncio.run(serve(args.port, args.pidfile, args.fix_sync_group))
        return
    if args.command in ("stop", "restart"):
        stopped = stop_background(pidfile_for(args.port), sig=signal.SIGKILL
                                  if args.command == "restart" else signal.SIGTERM)
        if args.command == "stop":
            print("kafka mock: stopped" if stopped else "kafka mock: was not running")
            return
    ready = start_background(args.port, fix_sync_group=args.fix_sync_group)
    print(f"kafka mock: ready at {ready} (pid file {pidfile_for(args.port)})")


if __name__ == "__main__":
    main()
