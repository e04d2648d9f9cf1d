"""The unit tier's own guards (tests/unit/conftest.py): no connection to any
address, loopback included; what the event loop needs still works."""

from __future__ import annotations

import asyncio
import socket

import pytest


@pytest.mark.parametrize(("family", "kind", "address"), [
    (socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 5432)),
    (socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 53)),
    (socket.AF_INET6, socket.SOCK_STREAM, ("::1", 6379)),
])
def test_no_connection_leaves_the_process(family: int, kind: int, address: object) -> None:
    with socket.socket(family, kind) as sock:
        with pytest.raises(AssertionError, match="tests/unit opens no network connection"):
            sock.connect(address)
        with pytest.raises(AssertionError, match="tests/unit opens no network connection"):
            sock.connect_ex(address)


async def test_nor_through_the_event_loop() -> None:
    with pytest.raises(AssertionError, match="tests/unit opens no network connection"):
        await asyncio.open_connection("127.0.0.1", 5672)


def test_socket_pairs_still_work() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"x")
        assert right.recv(1) == b"x"
