"""Typing a user can use: mypy in a user's own project finds duebox (also
under the README's editable install), and every producer call says what it
returns for a sync and for an async session (docs/typing in README)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TYPING = ROOT / "tests" / "typing"


@pytest.fixture(scope="module")
def mypy_output() -> dict[str, dict[int, str]]:
    """One ``mypy --strict`` run over both files, from a folder outside this
    repository (as a user's project), errors by file and line."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "typecheck-user"), str(TYPING / "user_api.py"),
         str(TYPING / "user_api_wrong.py")],
        capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
        timeout=240)
    errors: dict[str, dict[int, str]] = {}
    for line in out.stdout.splitlines():
        m = re.match(r"(\w+\.py):(\d+): error: (.*)", line)
        if m:
            errors.setdefault(m[1], {})[int(m[2])] = m[3]
    assert "Cannot find implementation or library stub" not in out.stdout, out.stdout
    assert out.returncode == (1 if errors else 0), out.stdout + out.stderr
    return errors


def test_users_code_type_checks_clean(mypy_output: dict[str, dict[int, str]]) -> None:
    assert mypy_output.get("user_api.py", {}) == {}


def test_misuse_is_an_error_on_each_marked_line(mypy_output: dict[str, dict[int, str]]) -> None:
    source = (TYPING / "user_api_wrong.py").read_text().splitlines()
    marked = {n for n, line in enumerate(source, 1) if "# E:" in line}
    assert len(marked) == 8
    assert set(mypy_output.get("user_api_wrong.py", {})) == marked, mypy_output
    errors = mypy_output["user_api_wrong.py"]
    assert 'Coroutine[Any, Any, UUID]' in errors[min(marked)]


def test_editable_install_is_a_plain_path_for_type_checkers() -> None:
    """The README's `pip install -e .` adds a directory holding duebox and its
    py.typed to sys.path: mypy and pyright do not run setuptools' import hook."""
    from installed import editable_paths

    paths = editable_paths()
    if paths is None:
        pytest.skip("duebox is not installed editable here")
    assert any((p / "duebox" / "py.typed").is_file() for p in paths), paths
