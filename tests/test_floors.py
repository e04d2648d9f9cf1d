"""The floors (docs/design.md, "Where things live"): core imports nothing from
the floors above it, and every edge upward is an import statement that
``lint-imports`` checks.  Brokers are found by URL scheme in core's registry,
which the brokers floor fills (brokers/schemes.py); the public API's names
from above (``duebox.Worker``, ...) come from ``duebox.above``, on the top
floor.  The contracts are pyproject.toml's; here they are run on a copy of the
package with one import added, to show each one refuses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import duebox
from duebox import registry
from duebox.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"": "core", "brokers": "brokers", "relay": "relay", "consumers": "consumers",
           "cli": "cli", "dashboard": "dashboard"}


def test_import_duebox_knows_every_scheme_and_imports_no_backend() -> None:
    code = ("import sys, duebox; from duebox.registry import schemes, broker_class; "
            "print(schemes()); "
            "print(sorted(m for m in sys.modules if m.startswith('duebox.brokers.'))); "
            "broker_class('memory://'); "
            "print(sorted(m for m in sys.modules if m.startswith('duebox.brokers.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == repr(["amqp", "amqps", "kafka", "memory", "redis", "rediss", "sql", "sqs"])
    assert out[1] == repr(["duebox.brokers.base", "duebox.brokers.schemes"])
    assert out[2] == repr(["duebox.brokers.base", "duebox.brokers.memory",
                           "duebox.brokers.schemes"])


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test go when it ends."""
    monkeypatch.setattr(registry, "_SCHEMES", dict(registry._SCHEMES))


@pytest.mark.usefixtures("own_registry")
def test_a_backend_of_your_own_is_imported_when_its_scheme_is_first_used() -> None:
    from duebox.brokers.memory import MemoryBroker

    calls: list[str] = []

    def backend() -> type[MemoryBroker]:
        calls.append("imported")
        return MemoryBroker

    registry.register_broker("Mine+Test", backend)
    assert calls == []
    app = duebox.Duebox("sqlite://", "mine+test://anywhere")
    try:
        assert calls  # checked when the app was made
        assert type(app.broker()) is MemoryBroker
    finally:
        app.dispose()
    with pytest.raises(ConfigurationError, match=r"unknown scheme 'nope'.*mine\+test://"):
        registry.broker_class("nope://h")


@pytest.mark.usefixtures("own_registry")
@pytest.mark.parametrize(("scheme", "backend", "rule"), [
    ("", lambda: None, "a URL scheme"),
    ("1redis", lambda: None, "a URL scheme"),
    ("re dis", lambda: None, "a URL scheme"),
    ("redis://", lambda: None, "a URL scheme"),
    (b"redis", lambda: None, "a URL scheme"),
    ("nats", "mypkg.nats:NatsBroker", "a function returning"),
])
def test_register_broker_refuses_what_is_no_scheme_or_no_backend(
        scheme: object, backend: object, rule: str) -> None:
    before = registry.schemes()
    with pytest.raises(ConfigurationError, match=f"register_broker: .*{rule}"):
        registry.register_broker(scheme, backend)  # type: ignore[arg-type]
    assert registry.schemes() == before


# --- the contracts refuse an upward import ------------------------------------------


def _package_copy(tmp_path: Path) -> Path:
    """The package laid out as Python imports it (pyproject's package-dir)."""
    tree = tmp_path / "tree"
    for sub, folder in FOLDERS.items():
        shutil.copytree(ROOT / folder, tree / "duebox" / sub, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    linter = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(linter), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def _add_line(path: Path, line: str) -> None:
    text = path.read_text()
    head, _, rest = text.partition("\nfrom __future__ import annotations\n")
    path.write_text(f"{head}\nfrom __future__ import annotations\n{line}\n{rest}" if rest
                    else f"{line}\n{text}")


@pytest.mark.parametrize(("change", "broken"), [
    (lambda t: None, None),
    # The package's face, beyond the registrations it is allowed.
    (lambda t: _add_line(t / "duebox/__init__.py", "import duebox.relay.shards"),
     "The package's face imports from the floors above core only"),
    # A core module finding a backend by importing it, as the registry once did.
    (lambda t: _add_line(t / "duebox/registry.py", "import duebox.brokers.sql"),
     "Floors: core <- brokers"),
    # A lower floor reaching for the top floor's names.
    (lambda t: _add_line(t / "duebox/relay/held.py", "from duebox.above import Worker"),
     "Floors: core <- brokers"),
], ids=["as-is", "face", "core", "relay-to-top"])
def test_the_contracts_refuse_an_import_up_the_floors(
        tmp_path: Path, change: Callable[[Path], None], broken: str | None) -> None:
    tree = _package_copy(tmp_path)
    change(tree)
    result = _lint_imports(tree)
    output = " ".join((result.stdout + result.stderr).split())
    if broken is None:
        assert result.returncode == 0, output
    else:
        assert result.returncode != 0
        assert f"{broken}" in output.split("Broken contracts")[-1], output
