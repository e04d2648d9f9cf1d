"""duebox.config: each ``DUEBOX_*`` variable reaches its setting as the
setting's type, arguments win over the environment, ``with_`` changes only
what it is given, and the derived views (routes, own queues, secret keys)
agree with what was set.  (Refusals by name are tests/badinput/test_cli_env.py's.)"""

from __future__ import annotations

import pytest

from duebox import ConfigurationError, Settings
from duebox.fairness.policy import DispatchPolicy


def test_each_variable_arrives_as_its_settings_type() -> None:
    s = Settings.from_env({
        "DUEBOX_DATABASE_URL": "sqlite:///x.db", "DUEBOX_BROKER_URL": "memory://m",
        "DUEBOX_BATCH_SIZE": "7", "DUEBOX_POLL_INTERVAL": "0.25", "DUEBOX_NOTIFY": "off",
        "DUEBOX_MASK_KEYS": "pin, otp", "DUEBOX_REMOVED_SCHEDULES": "delete",
        "DUEBOX_DISPATCH_POLICY": '{"rate": 5}', "DUEBOX_BROKER_ROUTES": "mail=redis://h/0",
        "DUEBOX_UNRELATED": "x", "DUEBOX_CONCURRENCY": ""})
    assert (s.database_url, s.broker_url, s.batch_size, s.poll_interval, s.notify) == (
        "sqlite:///x.db", "memory://m", 7, 0.25, False)
    assert type(s.batch_size) is int
    assert type(s.poll_interval) is float
    assert s.mask_keys == ("pin", "otp")
    assert s.secret_keys.hides("user_PIN")
    assert s.removed_schedules == "delete"
    assert s.dispatch_policy == DispatchPolicy(rate=5)
    assert s.routes == {"mail": "redis://h/0"}
    assert s.concurrency == Settings().concurrency  # empty: the default


def test_arguments_win_over_the_environment_and_none_is_no_argument() -> None:
    env = {"DUEBOX_BATCH_SIZE": "7", "DUEBOX_LEASE_SECONDS": "9"}
    s = Settings.from_env(env, batch_size=3, lease_seconds=None)
    assert (s.batch_size, s.lease_seconds) == (3, 9.0)


def test_with_changes_only_what_it_is_given_and_checks_it() -> None:
    base = Settings(batch_size=5)
    changed = base.with_(lease_seconds=12.0, batch_size=None)
    assert (changed.batch_size, changed.lease_seconds) == (5, 12.0)
    assert base.lease_seconds == Settings().lease_seconds  # frozen: the original stands
    with pytest.raises(ConfigurationError, match=r"^lease_seconds: "):
        base.with_(lease_seconds=0)


@pytest.mark.parametrize(("value", "flag"), [
    ("1", True), ("true", True), ("YES", True), ("on", True),
    ("0", False), ("False", False), ("no", False), ("OFF", False),
])
def test_booleans_in_any_spelling(value: str, flag: bool) -> None:
    assert Settings.from_env({"DUEBOX_NOTIFY": value}).notify is flag


def test_the_views_of_an_unset_setting() -> None:
    s = Settings()
    assert (s.routes, s.own_queues, s.broker_routes) == ({}, (), None)
    assert s.secret_keys.hides("password")
    assert not Settings(mask_keys="none").secret_keys
