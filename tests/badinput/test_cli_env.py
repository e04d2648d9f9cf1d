"""Settings, ``DUEBOX_*`` environment variables and command-line arguments:
a bad value names the setting, variable or option, the command exits
non-zero with one clear line — no traceback, no relay or worker started —
and the database is unchanged."""

from __future__ import annotations

import math
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import memory_url
from hypothesis import given, settings
from hypothesis import strategies as st

import duebox
from duebox import ConfigurationError, DatabaseError, Settings
from duebox.cli.main import cli
from duebox.db import check_reachable, create_sync_engine
from duebox.relay import Relay
from tests.apps import cli_app

from .common import SQLITE_ONLY, snapshot

APP = ["--app", "tests.apps.cli_app:app"]
NUMERIC = ["batch_size", "concurrency", "poll_interval", "lease_seconds", "clock_skew_margin",
           "redeliver_after", "catchup_rate", "catchup_after", "misfire_grace",
           "max_payload_bytes"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"batch_size": 0}, "batch_size"), ({"batch_size": True}, "batch_size"),
     ({"concurrency": -1}, "concurrency"), ({"lease_seconds": 0}, "lease_seconds"),
     ({"poll_interval": -1.0}, "poll_interval"), ({"clock_skew_margin": -1}, "clock_skew_margin"),
     ({"database_url": ""}, "database_url"), ({"broker_url": 5}, "broker_url"),
     ({"poll_interval": math.nan}, "poll_interval"), ({"lease_seconds": math.inf}, "lease_seconds"),
     ({"clock_skew_margin": math.nan}, "clock_skew_margin"),
     ({"catchup_rate": True}, "catchup_rate"), ({"max_payload_bytes": 0}, "max_payload_bytes")],
)
def test_bad_settings_name_the_setting(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        Settings(**changes)


@pytest.mark.parametrize(("name", "value"), [
    ("DUEBOX_BATCH_SIZE", "many"), ("DUEBOX_POLL_INTERVAL", "nan"),
    ("DUEBOX_LEASE_SECONDS", "inf"), ("DUEBOX_NOTIFY", "perhaps"),
    ("DUEBOX_CONCURRENCY", "1.5"), ("DUEBOX_MAX_PAYLOAD_BYTES", "-1"),
])
def test_a_bad_environment_variable_is_named(name: str, value: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        Settings.from_env({name: value})
    setting = name.removeprefix("DUEBOX_").lower()
    assert name in str(info.value) or str(info.value).startswith(setting)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from([*NUMERIC, "notify", "broker_url"]),
                       st.text(max_size=12) | st.sampled_from(["nan", "-inf", "0", "1e999"]),
                       min_size=1, max_size=3))
def test_any_environment_builds_settings_or_names_the_variable(values: dict[str, str]) -> None:
    env = {f"DUEBOX_{k.upper()}": v for k, v in values.items()}
    message = ""
    try:
        made = Settings.from_env(env)
    except ConfigurationError as exc:
        message = str(exc)
    if message:
        assert any(f"DUEBOX_{k.upper()}" in message or message.startswith(k)
                   for k in values), message
    else:
        for name in NUMERIC:
            assert math.isfinite(getattr(made, name))


@pytest.mark.parametrize("url", ["not a url", "nosuchdialect://x/y"])
def test_a_malformed_database_url_names_database_url(url: str) -> None:
    with pytest.raises(ConfigurationError, match="database_url"):
        create_sync_engine(url)


def test_an_unreachable_database_is_a_database_error() -> None:
    engine = create_sync_engine("postgresql+psycopg://127.0.0.1:1/x",
                                connect_args={"connect_timeout": 3})
    try:
        with pytest.raises(DatabaseError) as info:
            check_reachable(engine)
        assert "database_url" in str(info.value)
        assert info.value.__cause__ is not None  # the driver's error, chained
    finally:
        engine.dispose()


async def test_a_relay_pass_against_an_unreachable_database_raises_database_error() -> None:
    app = duebox.Duebox("postgresql+psycopg://127.0.0.1:1/x", memory_url())
    try:
        with pytest.raises(DatabaseError):
            await Relay(app).run_pass()
    finally:
        await app.adispose()


# --- the command line ---------------------------------------------------------------------


# (args, environment, what the error must name).  A long-running command
# that accepted its bad input would run until the test's timeout: each of
# these must be refused before the relay or worker starts.
CLI_CASES: list[tuple[list[str], dict[str, str], str]] = [
    (["worker", *APP, "--concurrency", "0"], {}, "--concurrency"),
    (["worker", *APP, "--concurrency", "-1"], {}, "--concurrency"),
    (["worker", *APP], {"DUEBOX_CONCURRENCY": "lots"}, "--concurrency"),
    (["worker", *APP, "--processes", "0"], {}, "--processes"),
    (["worker", *APP, "--processes", "-1"], {}, "--processes"),
    (["worker", *APP, "--processes", "abc"], {}, "--processes"),
    (["worker", *APP, "--processes", "257"], {}, "--processes"),
    (["worker", *APP, "--processes", "9" * 400], {}, "--processes"),
    (["worker", *APP, "--processes", "1_0"], {}, "--processes"),
    (["worker", *APP, "--processes", "\u0664"], {}, "--processes"),  # ARABIC-INDIC FOUR
    (["worker", *APP, "--processes", "2.0"], {}, "--processes"),
    (["worker", *APP, "--processes", ""], {}, "--processes"),
    (["worker", *APP], {"DUEBOX_PROCESSES": ""}, "DUEBOX_PROCESSES is set but empty"),
    (["worker", *APP], {"DUEBOX_PROCESSES": "  "}, "--processes"),
    (["worker", *APP], {"DUEBOX_PROCESSES": "lots"}, "from DUEBOX_PROCESSES"),
    (["worker", *APP], {"DUEBOX_PROCESSES": "0"}, "from DUEBOX_PROCESSES"),
    (["relay", "--batch-size", "0"], {}, "batch_size"),
    (["relay"], {"DUEBOX_BATCH_SIZE": "many"}, "--batch-size"),
    (["relay", "--poll-interval", "nan"], {}, "poll_interval"),
    (["relay", "--metrics-port", "70000"], {}, "--metrics-port"),
    (["relay"], {"DUEBOX_METRICS_PORT": "-1"}, "--metrics-port"),
    (["relay", "--broker-url", "nats://x"], {}, "broker_url"),
    (["relay"], {"DUEBOX_BROKER_URL": "redis://127.0.0.1:1/0?prefx=x"}, "prefx"),
    (["relay", "--database-url", ""], {}, "database_url"),
    (["relay", "--app", "no.such.module:app"], {}, "--app"),
    (["--log-level", "LOUD", "status"], {}, "--log-level"),
    (["jobs", "list", "--state", "bogus"], {}, "--state"),
    (["jobs", "list", "--limit", "0"], {}, "--limit"),
    (["jobs", "show", "not-a-uuid"], {}, "no such job"),
    (["jobs", "show", "key\x1b[2Jx"], {}, "JOB: must not contain control characters"),
    (["jobs", "show", "k" * 100_000], {}, "JOB: must be at most 400 characters"),
    (["jobs", "show", "00000000-0000-0000-0000-00000000000%"], {}, "no such job"),
    (["jobs", "cancel", "not-a-uuid", "--operator", "a", "--reason", "b"], {}, "JOB_ID"),
    (["jobs", "cancel", "00000000-0000-0000-0000-000000000000", "--operator", "a",
      "--reason", "b"], {}, "no such job"),
    (["status", "--window", "0"], {}, "--window"),
    # NaN passed click's FloatRange (every comparison with it is false), and
    # a huge or infinite window overflowed: a traceback, not a refusal.
    *((["status", "--window", v], {}, "--window") for v in ("nan", "1e300", "inf", "-inf")),
    *((["status", "--max-due-age", v], {}, "--max-due-age")
      for v in ("nan", "1e300", "inf", "-1")),
    *((["status", "--watch", v, "--iterations", "2"], {}, "--watch")
      for v in ("nan", "1e300", "inf", "0")),
    (["dashboard", "--port", "0", "--refresh", "nan"], {}, "--refresh"),
    (["dashboard", "--port", "0"], {"DUEBOX_DASHBOARD_REFRESH": "nan"}, "--refresh"),
    (["demo", "--spread", "nan"], {}, "--spread"),
    (["demo", "--spread", "inf"], {}, "--spread"),
    (["relay", "--poll-interval", "1e300"], {}, "poll_interval"),
    (["relay", "--poll-interval", "-inf"], {}, "poll_interval"),
    (["relay", "--batch-size", "9" * 40], {}, "batch_size"),
    (["jobs", "list", "--limit", "9" * 40], {}, "--limit"),
    (["schedules", "next", "nightly", "-n", "-1"], {}, "-n"),
    (["dlq", "list", "--error-class", "bogus"], {}, "--error-class"),
    (["dlq", "replay", "--all", "--operator", "a", "--reason", "b", "--rate", "0"], {},
     "--rate"),
    *((["dlq", "replay", "--all", "--operator", "a", "--reason", "b", "--rate", v], {},
       "--rate") for v in ("nan", "inf", "-1")),
    (["dlq", "replay", "--operator", "a", "--reason", "b"], {}, "--all"),
    (["dlq", "replay", "not-a-uuid", "--operator", "a", "--reason", "b"], {}, "JOB_ID"),
]


@SQLITE_ONLY
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "env", "named"), CLI_CASES,
                         ids=[" ".join(c[0])[:60] for c in CLI_CASES])
def test_a_bad_argument_or_variable_is_named_and_changes_nothing(
    runner: CliRunner, database_url: str, args: list[str], env: dict[str, str], named: str
) -> None:
    with cli_app.app.engine.begin() as conn:
        cli_app.app.schedule(conn, "cli.noop", delay=3600)
    before = snapshot(cli_app.app.engine)
    result = runner.invoke(cli, args, env=env)
    assert result.exit_code in (1, 2), (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert named in result.output, result.output
    assert "Traceback" not in result.output
    assert snapshot(cli_app.app.engine) == before
