"""duebox.dashboard.throttle: failed authentication costs a token from the
client's bucket and everyone's; an empty bucket answers "retry after" for
as long as it takes one token to drip back.  An IPv6 client counts by its
/64; an IPv4-mapped one as its IPv4 address.  The clock is the test's."""

from __future__ import annotations

import logging

import pytest

from duebox.dashboard.throttle import KEEP_CLIENTS, Throttle, client_key

from ..conftest import Seconds


def test_a_client_may_fail_its_allowance_then_waits_for_a_token(seconds: Seconds) -> None:
    t = Throttle(seconds, per_client=3, overall=100, window=60.0)
    for _ in range(2):
        t.failed("10.0.0.1")
        assert t.retry_after("10.0.0.1") is None
    t.failed("10.0.0.1")
    assert t.retry_after("10.0.0.1") == 20  # one token of 3 a minute
    assert t.retry_after("10.0.0.2") is None  # another client is not held back
    seconds.now += 19.5
    assert t.retry_after("10.0.0.1") == 1
    seconds.now += 0.5
    assert t.retry_after("10.0.0.1") is None


def test_everyones_bucket_holds_back_every_client(seconds: Seconds) -> None:
    t = Throttle(seconds, per_client=100, overall=4, window=60.0)
    for n in range(4):
        t.failed(f"10.0.0.{n}")
    assert t.retry_after("192.168.1.1") == 15


def test_ipv6_counts_by_its_64_and_mapped_ipv4_as_ipv4(seconds: Seconds) -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert client_key("not an address") == "not an address"
    t = Throttle(seconds, per_client=2, overall=100)
    t.failed("2001:db8:1:2::1")
    t.failed("2001:db8:1:2:ffff::9")
    assert t.retry_after("2001:db8:1:2::77") is not None
    assert t.retry_after("2001:db8:1:3::1") is None


def test_a_persistent_guesser_is_logged_once_a_window(seconds: Seconds,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    t = Throttle(seconds, per_client=1, overall=1000, window=60.0)
    with caplog.at_level(logging.WARNING, logger="duebox.dashboard"):
        for _ in range(50):
            t.failed("10.0.0.9")
            seconds.now += 1.0
    assert len(caplog.records) == 1  # 50 s: within one window
    assert "10.0.0.9 failed to authenticate" in caplog.records[0].getMessage()


def test_the_clients_remembered_are_bounded(seconds: Seconds) -> None:
    t = Throttle(seconds, per_client=1, overall=10**9)
    t.failed("10.255.255.255")
    for n in range(KEEP_CLIENTS):
        t.failed(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}")
    assert t.retry_after("10.255.255.255") is None  # the least recent was forgotten
    assert t.retry_after("10.0.0.0") is not None
