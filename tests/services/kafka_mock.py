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
import sys
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
        for key, value in (("log_level", "3"), ("client.id", "duebox-kafka-mock")):
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


async def serve(port: int, pidfile: str | None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    holder: dict[str, MockCluster] = {}

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, real = holder["mock"].real
        try:
            up_r, up_w = await asyncio.open_connection(host, real)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_w), _pump(up_r, writer))

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
        if pidfile:
            Path(pidfile).unlink(missing_ok=True)  # noqa: ASYNC240 - once, at exit


RUN = Path(__file__).resolve().parent / ".run"
PIDFILE = RUN / "kafka-mock.pid"


def start_background(port: int, *, pidfile: Path = PIDFILE, timeout: float = 30.0) -> str:
    """Start this script detached; return ``host:port`` once it is ready."""
    import shlex
    import subprocess
    import time

    pidfile.parent.mkdir(parents=True, exist_ok=True)
    log = pidfile.with_suffix(".log")
    log.write_text("")
    # Detached through a shell that exits at once: the mock is nobody's child
    # here, so no Popen object is left to be collected while it runs.
    command = " ".join(shlex.quote(a) for a in (
        sys.executable, __file__, "run", "--port", str(port), "--pidfile", str(pidfile)))
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


def stop_background(pidfile: Path = PIDFILE, sig: int = signal.SIGTERM) -> bool:
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
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description="librdkafka's mock Kafka cluster at a fixed address, for duebox's tests.")
    parser.add_argument("command", nargs="?", default="run",
                        choices=["run", "start", "stop", "restart"],
                        help="run: in the foreground; start: detached, returns when ready "
                             "(pid file in tests/services/.run); stop; restart: SIGKILL, "
                             "then start an empty cluster at the same address")
    parser.add_argument("--port", type=int, default=19092,
                        help="the fixed port clients use (0: any free port with run)")
    parser.add_argument("--pidfile", help="run: write this process's id here while it runs")
    args = parser.parse_args()
    if args.command == "run":
        asyncio.run(serve(args.port, args.pidfile))
        return
    if args.command in ("stop", "restart"):
        stopped = stop_background(sig=signal.SIGKILL if args.command == "restart"
                                  else signal.SIGTERM)
        if args.command == "stop":
            print("kafka mock: stopped" if stopped else "kafka mock: was not running")
            return
    print(f"kafka mock: ready at {start_background(args.port)} (pid file {PIDFILE})")


if __name__ == "__main__":
    main()
