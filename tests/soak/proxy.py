"""A small TCP proxy the soak owns, between duebox's processes and one
service (the broker, or PostgreSQL for ``sql://``), so network faults hit
only the soak's own connections:

* ``cut``: every open connection is reset and new ones are refused;
* ``stall``: connections stay open but no byte moves either way;
* ``slow``: every chunk is held back 50-250 ms;
* ``pass``: back to normal.

It is a process of its own (``python -m tests.soak.proxy HOST PORT``, driven
by :class:`Proxy`), so that the traffic of six duebox processes is not
squeezed through the harness's own CPU share: commands are mode names on
stdin, each answered ``ok``, or ``accepted``, answered with the number of
connections accepted so far; the first line out is ``port N``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import sys
import threading

MODES = ("pass", "cut", "stall", "slow")


class Forwarder:
    """The proxy itself: its own event loop in a daemon thread."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode = "pass"
        self._open: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-proxy", daemon=True)
        self.port = 0
        self.accepted = 0

    def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the soak's TCP proxy did not start")
        return self.port

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._flowing.set()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"proxy mode: must be one of {MODES} (got {mode!r})")
        done = threading.Event()

        def apply() -> None:
            self.mode = mode
            if mode == "stall":
                self._flowing.clear()
            else:
                self._flowing.set()
            if mode == "cut":
                for w in list(self._open):
                    self._reset(w)
            done.set()

        self._loop.call_soon_threadsafe(apply)
        done.wait(5)

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # SO_LINGER 0: close with a RST, as a dropped network path looks.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)
        writer.transport.abort()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode == "cut":
            self._reset(writer)
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            self._reset(writer)
            return
        self._open.update((writer, up_w))
        try:
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer),
                                 return_exceptions=True)
        finally:
            for w in (writer, up_w):
                self._open.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()
                if self.mode == "slow":
                    await asyncio.sleep(random.uniform(0.05, 0.25))
                if writer.transport.is_closing():
                    break
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                if writer.can_write_eof():
                    writer.write_eof()

    def close(self) -> None:
        def shut() -> None:
            for w in list(self._open):
                w.transport.abort()
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(shut)
            self._thread.join(5)


class Proxy:
    """The harness's handle on a forwarder process."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self._lock = threading.Lock()

    def start(self) -> int:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.soak.proxy", self.target[0], str(self.target[1])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "port":
            raise RuntimeError(f"the soak's TCP proxy did not start (said {line!r})")
        self.port = int(line[1])
        return self.port

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"proxy mode: must be one of {MODES} (got {mode!r})")
        assert self.proc is not None
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(mode + "\n")
            answer = self.proc.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"the soak's TCP proxy did not take mode {mode!r} ({answer!r})")

    def accepted(self) -> int:
        """How many connections the proxy has accepted (and passed or cut)."""
        assert self.proc is not None
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write("accepted\n")
            return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:  # its pipes too (warnings are errors in the tests)
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()


def main(host: str, port: str) -> None:
    fwd = Forwarder(host, int(port))
    print(f"port {fwd.start()}", flush=True)
    for line in sys.stdin:
        if line.strip() == "accepted":
            print(fwd.accepted, flush=True)
            continue
        fwd.set_mode(line.strip())
        print("ok", flush=True)
    fwd.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
