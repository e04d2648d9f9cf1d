"""Secrets are masked app-wide by default (issue #33 item 10): a payload's
``password``, ``token``, ``api_key``... and the values error text quotes
after such keys never reach the worker's log, the stored traceback,
``duebox jobs show``, ``dlq list`` or ``dlq show``, with no option on the
task; ``mask_keys`` (the setting, or a task's own) changes the list.

Run as a user runs it: a ``duebox worker`` process and ``duebox`` commands,
against SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import attempt_rows, job_row, wait_for

import duebox
from duebox.secret_keys import DEFAULT_MASK_KEYS, SecretKeys
from tests.apps import secrets_app

ROOT = Path(__file__).resolve().parents[1]
APP = ["--app", "tests.apps.secrets_app:app"]


def duebox_command(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "duebox", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def start_worker(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "duebox", "worker", *APP, "--processes", "1"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


async def test_secrets_stay_out_of_logs_jobs_show_and_the_dlq(database_url: str) -> None:
    token = f"tok-{uuid.uuid4().hex}"
    # Short enough for `dlq list`, which shows an error's first 70 characters.
    pw = {name: f"pw-{name}-{uuid.uuid4().hex[:6]}"
          for name in ("login", "login-unmasked", "login-pin")}
    pin = f"pin-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DUEBOX_DATABASE_URL": database_url, "SECRETS_APP_TOKEN": token,
           "DUEBOX_POLL_INTERVAL": "0.05", "DUEBOX_LOG_FORMAT": "json"}
    env.pop("DUEBOX_MASK_KEYS", None)
    producer = secrets_app.build(database_url)
    ids = {}
    with producer.engine.begin() as conn:
        for name, password in pw.items():
            payload = {"user": "bob", "password": password}
            if name == "login-pin":
                payload["pin"] = pin
            ids[name] = producer.schedule(conn, name, payload)
    worker = start_worker(env)
    try:
        await wait_for(lambda: all(job_row(producer.engine, i).state == "DEAD"
                                   for i in ids.values()),
                       timeout=60, what="the three jobs to be dead-lettered",
                       check=lambda: worker.poll() is None or pytest.fail("worker exited"))
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=30)
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    logged = {name: json.dumps([r for r in records if r.get("job_id") == str(job_id)])
              for name, job_id in ids.items()}
    # The attempt's traceback as stored (its error column, like the job's
    # last_error, keeps the text whole: whoever shows it masks it).
    stored = {name: "\n".join(a.traceback for a in attempt_rows(producer.engine, i))
              for name, i in ids.items()}
    shown = {name: duebox_command(["jobs", "show", str(i), *APP], env)
             for name, i in ids.items()}
    dead = {name: duebox_command(["dlq", "show", str(i), *APP], env)
            for name, i in ids.items()}
    listed = duebox_command(["dlq", "list", *APP], env)
    producer.dispose()

    # Every place says the job was refused, and the default task hides both
    # the payload's password and the token its error quoted.
    for where in (logged, stored, shown, dead):
        assert "refused {'password': '****', 'user': 'bob'}" in where["login"], where["login"]
        assert pw["login"] not in where["login"]
        assert token not in where["login"]
    for where in (logged, stored, dead):
        assert "'Authorization': '****'" in where["login"], where["login"]
    assert '"password": "****"' in dead["login"]  # the payload dlq show prints
    login_line = next(line for line in listed.splitlines() if str(ids["login"]) in line)
    assert "Permanent: refused {'password': '****', 'user': 'bob'}" in login_line
    assert all(pw["login"] not in line and token not in line for line in listed.splitlines()
               if str(ids["login-unmasked"]) not in line)
    # A task that opted out (mask_keys=()) shows what it was given...
    assert pw["login-unmasked"] in shown["login-unmasked"]
    assert token in logged["login-unmasked"]
    # ...and one with keys of its own masks those, and only those.
    for where in (logged, stored, shown, dead):
        assert pin not in where["login-pin"]
        assert pw["login-pin"] in where["login-pin"]


def test_the_setting_changes_the_list_for_the_whole_app() -> None:
    payload = {"user": "bob", "password": "hunter2", "otp": "123456", "api_key": "k-1"}
    cases = {
        None: {"user": "bob", "password": "****", "otp": "123456", "api_key": "****"},
        "otp": {"user": "bob", "password": "hunter2", "otp": "****", "api_key": "k-1"},
        "none": payload,
    }
    for setting, expected in cases.items():
        environ = {} if setting is None else {"DUEBOX_MASK_KEYS": setting}
        app = duebox.Duebox.from_env(environ)
        app.add_task("login", lambda p, c: None)
        seen = duebox.masking.masked(app, "login", payload)
        assert seen.payload == expected, setting
        assert (seen.text("bad: password=hunter2") == "bad: password=hunter2") \
            == (setting is not None), setting
    # Changing the setting later applies to the tasks already registered.
    app = duebox.Duebox.from_env({})
    app.add_task("login", lambda p, c: None)
    app.configure(mask_keys="otp")
    assert duebox.masking.masked(app, "login", payload).payload["otp"] == "****"


@pytest.mark.parametrize(("key", "secret"), [
    ("password", True), ("DB_PASSWORD", True), ("passwd", True), ("client_secret", True),
    ("access_token", True), ("apiKey", True), ("X-Api-Key", True), ("Authorization", True),
    ("set-cookie", True), ("private_key", True), ("credentials", True),
    ("user", False), ("author", False), ("order_id", False), ("", False), ("pass", False),
])
def test_which_keys_are_secret_by_default(key: str, secret: bool) -> None:
    assert SecretKeys(DEFAULT_MASK_KEYS).hides(key) is secret


@pytest.mark.parametrize(("text", "expected"), [
    ("ValueError: {'user': 'bob', 'password': 'hunter2'}",
     "ValueError: {'user': 'bob', 'password': '****'}"),
    ('{"token": "t0k", "n": 1}', '{"token": "****", "n": 1}'),
    ("401 for https://api.example/x?api_key=abc123&q=1", "401 for https://api.example/x?api_key=****&q=1"),
    ("headers: Authorization: Bearer abc.def", "headers: Authorization: Bearer ****"),
    ("Client(password='a b', user='x')", "Client(password='****', user='x')"),
    ("{'secret': b'raw'}", "{'secret': b'****'}"),
    ("DB_PASSWORD=s3cr3t;", "DB_PASSWORD=****;"),
    # Code in a traceback is left alone: no value follows the key directly.
    ("    token = fetch_token()", "    token = fetch_token()"),
    ("author: bob; user=alice", "author: bob; user=alice"),
])
def test_error_text_quoting_a_secret_key_is_scrubbed(text: str, expected: str) -> None:
    assert SecretKeys(DEFAULT_MASK_KEYS).scrub(text) == expected


def test_hostile_payloads_and_text_cost_linear_time_and_no_recursion() -> None:
    keys = SecretKeys(DEFAULT_MASK_KEYS)
    deep: Any = {"password": "p"}
    for _ in range(100_000):  # deeper than the recursion limit
        deep = {"next": [deep]}
    masked = keys.mask(deep)
    for _ in range(100_000):
        masked = masked["next"][0]
    assert masked == {"password": "****"}
    assert keys.mask({1: "x", "token": None, "items": ["token"]}) == {
        1: "x", "token": None, "items": ["token"]}
    for text in ("a" * 1_000_000, "password=x " * 100_000, "'" * 1_000_000,
                 "'password': '" + "x" * 1_000_000, ("a-" * 50 + "=") * 20_000,
                 "passwor " * 150_000, " " * 1_000_000):
        started = time.perf_counter()
        keys.scrub(text)
        # About 0.5 s for a megabyte on a busy 2-core machine; quadratic
        # behaviour would take minutes.  An error text is at most 16 kB.
        assert time.perf_counter() - started < 10, text[:20]


@pytest.mark.parametrize("value", [[""], ["-_-"], [42], "x" * 101, [f"k{i}" for i in range(101)],
                                   {"password"}])
def test_a_bad_mask_keys_setting_names_the_field(value: object) -> None:
    with pytest.raises(duebox.ConfigurationError, match="mask_keys"):
        duebox.Settings(mask_keys=value)  # type: ignore[arg-type]
    app = duebox.Duebox("sqlite://")
    with pytest.raises(duebox.ConfigurationError, match="mask_keys"):
        app.add_task("t", lambda p, c: None, mask_keys=value)
    assert app.tasks == {}
