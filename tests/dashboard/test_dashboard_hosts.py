"""Which Host headers the dashboard answers (DNS rebinding), following the
address it is bound to, IPv6 included, and names allowed explicitly."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from duebox.dashboard import DashboardServer
from duebox.dashboard.hosts import HostAllowList, host_name
from duebox.errors import ValidationError

from .conftest import Client
from .seed import Seeded
from .wire import get, request

Serve = Callable[..., Client]


@pytest.mark.parametrize(("bound", "header", "allowed"), [
    ("127.0.0.1", "127.0.0.1:8377", True),
    ("127.0.0.1", "localhost:8377", True),
    ("127.0.0.1", "LOCALHOST.", True),
    ("127.0.0.1", "[::1]:8377", True),
    ("127.0.0.1", "127.9.9.9", True),  # an IP literal cannot be rebound
    ("127.0.0.1", "evil.example", False),
    ("127.0.0.1", "127.0.0.1.nip.io", False),
    ("127.0.0.1", "", False),
    ("127.0.0.1", "127.0.0.1:99999999", False),
    ("127.0.0.1", "127.0.0.1:80:80", False),
    ("127.0.0.1", "::1", False),  # IPv6 needs brackets
    ("127.0.0.1", "[evil.example]", False),
    ("127.0.0.1", "[::1]x", False),
    ("127.0.0.2", "evil.example", False),  # was: any Host on a loopback other than .1
    ("127.0.0.2", "127.0.0.2:1234", True),
    ("::1", "[::1]:8377", True),
    ("::1", "[::ffff:127.0.0.1]", True),
    ("::1", "evil.example:8377", False),
    ("10.1.2.3", "10.1.2.3:8377", True),
    ("10.1.2.3", "10.9.9.9", False),
    ("10.1.2.3", "dash.example.com", False),
    ("0.0.0.0", "192.0.2.7:8377", True),
    ("0.0.0.0", "dash.example.com", False),
    ("::", "[2001:db8::1]:8377", True),
])
def test_the_allow_list_follows_the_bound_address(bound: str, header: str,
                                                  allowed: bool) -> None:
    assert HostAllowList(bound).allows(header) is allowed


def test_names_are_allowed_only_explicitly() -> None:
    hosts = HostAllowList("0.0.0.0", ["Dash.Example.com.", "[2001:db8::5]"])
    assert hosts.allows("dash.example.com:443")
    assert hosts.allows("DASH.EXAMPLE.COM")
    assert not hosts.allows("evil.dash.example.com")
    assert host_name("[2001:db8::5]:80") == "2001:db8::5"
    for bad in ("dash.example.com:8377", "*.example.com", "a b", "", "ex\x00ample.com"):
        with pytest.raises(ValidationError, match="allow_host"):
            HostAllowList("127.0.0.1", [bad])


def test_a_second_loopback_address_refuses_foreign_names(sqlite_seeded: Seeded,
                                                         serve: Serve) -> None:
    """``--host 127.0.0.2`` turned the Host check off."""
    c = serve(sqlite_seeded.app, host="127.0.0.2")
    assert c.base.startswith("http://127.0.0.2:")
    port = c.base.rsplit(":", 1)[1]
    assert request(c.base, get("/", host="evil.example")).status == 421
    assert request(c.base, get("/", host=f"127.0.0.2:{port}")).status == 200
    assert request(c.base, get("/", host=f"localhost:{port}")).status == 200


def test_ipv6_loopback(sqlite_seeded: Seeded, serve: Serve) -> None:
    """``--host ::1`` could not bind (an IPv4-only server)."""
    c = serve(sqlite_seeded.app, host="::1")
    assert c.base.startswith("http://[::1]:")
    port = c.base.rsplit(":", 1)[1]
    assert c.get("/").status == 200
    assert request(c.base, get("/", host=f"[::1]:{port}")).status == 200
    assert request(c.base, get("/", host=f"evil.example:{port}")).status == 421
    assert request(c.base, get("/", host=f"::1:{port}")).status == 421


def test_an_allowed_name_is_answered(sqlite_seeded: Seeded, serve: Serve) -> None:
    c = serve(sqlite_seeded.app, allow_hosts=["dash.example.com"])
    assert request(c.base, get("/", host="dash.example.com")).status == 200
    assert request(c.base, get("/", host="other.example.com")).status == 421
    with pytest.raises(ValidationError, match="allow_host"):
        DashboardServer(sqlite_seeded.app, port=0, allow_hosts=["dash.example.com:443"])
