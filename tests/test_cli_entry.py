"""How a user starts the command: ``python -m duebox`` and click's shell
completion (README, "Commands")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_python_dash_m_duebox_is_the_duebox_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/m.db"
    version = run([sys.executable, "-m", "duebox", "--version"])
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("duebox, version ")
    upgraded = run([sys.executable, "-m", "duebox", "db", "upgrade", "--database-url", url])
    assert upgraded.returncode == 0, upgraded.stderr
    assert "database at revision" in upgraded.stdout
    assert (tmp_path / "m.db").exists()
    wrong = run([sys.executable, "-m", "duebox", "no-such-command"])
    assert wrong.returncode == 2
    assert "No such command 'no-such-command'" in wrong.stderr


@pytest.mark.parametrize("launcher", ["duebox", "-m"])
def test_bash_completion_completes_commands_and_subcommands(launcher: str) -> None:
    cmd = ([str(Path(sys.executable).with_name("duebox"))] if launcher == "duebox"
           else [sys.executable, "-m", "duebox"])
    top = run(cmd, COMP_WORDS="duebox sch", COMP_CWORD="1", _DUEBOX_COMPLETE="bash_complete")
    assert top.stdout.split() == ["plain,schedules"]
    sub = run(cmd, COMP_WORDS="duebox jobs ", COMP_CWORD="2", _DUEBOX_COMPLETE="bash_complete")
    assert sorted(sub.stdout.split()) == ["plain,cancel", "plain,list", "plain,show"]
    option = run(cmd, COMP_WORDS="duebox worker --conc", COMP_CWORD="2",
                 _DUEBOX_COMPLETE="bash_complete")
    assert option.stdout.split() == ["plain,--concurrency"]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts_as_documented(shell: str) -> None:
    exe = str(Path(sys.executable).with_name("duebox"))
    out = run([exe], _DUEBOX_COMPLETE=f"{shell}_source")
    assert out.returncode == 0, out.stderr
    assert "_DUEBOX_COMPLETE" in out.stdout
    assert f"{shell}_complete" in out.stdout
