"""compose.yaml (the services for users with Docker, and the README's
deployment beside them) parses and says what the README promises; Docker
itself is not available to CI, so this is the check.  The deployment's
commands are the CLI's own (parsed by it here, run as processes in
tests/test_compose_deployment.py)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from duebox.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"postgres", "redis", "rabbitmq", "localstack", "kafka"}
DEPLOYMENT = {"migrate", "relay", "worker", "dashboard"}
_DEFAULT = re.compile(r"\$\{(\w+):-([^}]*)\}")


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def services() -> dict[str, Any]:
    found = load(ROOT / "compose.yaml")["services"]
    assert isinstance(found, dict)
    return found


def with_defaults(value: str) -> str:
    """A compose value with every ``${NAME:-default}`` at its default."""
    return _DEFAULT.sub(lambda m: m.group(2), value)


def test_compose_file_has_every_backend_service_on_loopback() -> None:
    compose = load(ROOT / "compose.yaml")
    found = services()
    assert set(found) == BACKENDS | DEPLOYMENT
    published = {}
    for name, service in found.items():
        assert isinstance(service["image"], str), name
        assert ":" in service["image"], f"{name}: pin a version"
        for port in service.get("ports", []):
            host, _outside, inside = port.split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond this machine"
            published[int(inside)] = name
    for name in BACKENDS:
        assert "profiles" not in found[name], f"{name}: `docker compose up` starts every backend"
        assert found[name]["healthcheck"]["test"], name  # `up --wait` waits for it
    assert {5432: "postgres", 6379: "redis", 5672: "rabbitmq", 4566: "localstack",
            9092: "kafka", 8377: "dashboard"}.items() <= published.items()
    for volume in found["postgres"].get("volumes", []):
        assert volume.split(":")[0] in compose["volumes"]


def test_localstack_matches_the_one_the_tests_run() -> None:
    root = services()["localstack"]
    own = load(ROOT / "localstack" / "compose.yaml")["services"]["localstack"]
    assert root == own
    pinned = (ROOT / "localstack" / "requirements.txt").read_text()
    assert f"localstack-core[runtime]=={root['image'].split(':')[1]}" in pinned


def test_kafka_advertises_an_address_each_side_can_reach() -> None:
    env = services()["kafka"]["environment"]
    advertised = dict(a.split("://") for a in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    assert advertised["HOST"] == "127.0.0.1:9092"  # the published port, from this machine
    assert advertised["INTERNAL"] == "kafka:19092"  # from the deployment's services
    listeners = {a.split("://")[0] for a in env["KAFKA_LISTENERS"].split(",")}
    assert set(advertised) | {env["KAFKA_CONTROLLER_LISTENER_NAMES"]} == listeners


def command_of(args: list[str]) -> tuple[click.Command, click.Context]:
    """The duebox command ``args`` name, parsed by the CLI itself: a
    misspelt command, an unknown option or a bad value fails here."""
    command: click.Command = cli
    parent = cli.make_context("duebox", [], resilient_parsing=True)
    rest = list(args)
    while isinstance(command, click.Group):
        name, rest = rest[0], rest[1:]
        sub = command.get_command(parent, name)
        assert sub is not None, f"duebox has no command {name!r} ({args})"
        command = sub
        if isinstance(command, click.Group):
            parent = command.make_context(name, [], parent=parent, resilient_parsing=True)
    return command, command.make_context(command.name or "", rest, parent=parent)


def test_the_deployment_runs_the_readmes_commands() -> None:
    found = services()
    readme = (ROOT / "README.md").read_text()
    for name in DEPLOYMENT:
        service = found[name]
        assert service["profiles"] == ["app"], f"{name}: `docker compose up` alone stays lean"
        assert service["build"] == "."
        assert service["init"] is True, f"{name}: a stop signal must reach the command"
        assert (ROOT / "Dockerfile").is_file()
        command, ctx = command_of(service["command"])
        assert f"duebox {command.name}" in readme or name == "migrate", name
        assert ctx.params, name
    assert command_of(found["migrate"]["command"])[0].name == "upgrade"
    assert "duebox db upgrade" in readme
    # Each long-running service waits for the tables (up --wait counts the
    # one-shot done when it exits 0, because these depend on it so).
    assert found["migrate"]["restart"] == "no"
    for name in DEPLOYMENT - {"migrate"}:
        depends = found[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        assert found[name]["restart"] == "unless-stopped", name


@pytest.mark.parametrize(("name", "option", "path"), [
    ("relay", "metrics_port", "/metrics"), ("worker", "metrics_port", "/metrics"),
    ("dashboard", "port", "/healthz")])
def test_each_health_check_asks_the_port_its_command_opens(name: str, option: str,
                                                           path: str) -> None:
    service = services()[name]
    _, ctx = command_of(service["command"])
    check = " ".join(service["healthcheck"]["test"])
    assert f"http://127.0.0.1:{ctx.params[option]}{path}" in check
    if name == "dashboard":
        assert ctx.params["host"] == "0.0.0.0", "else the published port cannot reach it"
        assert f"127.0.0.1:{ctx.params['port']}:{ctx.params['port']}" in service["ports"]


def test_the_default_app_is_an_app_with_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    service = services()["worker"]
    folder = with_defaults(service["volumes"][0]).split(":")[0]
    spec = with_defaults(service["environment"]["DUEBOX_APP"])
    module, _, attr = spec.partition(":")
    path = ROOT / folder / f"{module}.py"
    assert path.is_file(), path
    monkeypatch.setenv("DUEBOX_DATABASE_URL", "sqlite://")
    namespace: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # as `import jobs` would
    app = namespace[attr]
    assert app.tasks, f"{spec}: a worker refuses an app without tasks"
    app.dispose()
    broker = with_defaults(service["environment"]["DUEBOX_BROKER_URL"])
    assert broker.startswith("redis://redis:")
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_dockerfile_installs_the_package_it_is_given() -> None:
    """Every folder the package maps is copied, every extra it installs
    exists, and .dockerignore keeps none of them out."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = set()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _dest = shlex.split(line)[1:]
            for source in sources:
                assert (ROOT / source).exists(), source
                copied.add(source)
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders | {"pyproject.toml", "README.md"} <= copied
    extras = re.search(r"'\.\[([a-z,]+)\]'", dockerfile)
    assert extras is not None
    assert set(extras.group(1).split(",")) <= set(pyproject["project"]["optional-dependencies"])
    assert 'ENTRYPOINT ["duebox"]' in dockerfile
    assert "duebox" in pyproject["project"]["scripts"]
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not ignored & copied
