"""compose.yaml (the services for users with Docker) parses and says what the
README promises; Docker itself is not available to CI, so this is the check."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path) -> dict[str, object]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def test_compose_file_has_every_backend_service_on_loopback() -> None:
    compose = load(ROOT / "compose.yaml")
    services = compose["services"]
    assert isinstance(services, dict)
    assert set(services) == {"postgres", "redis", "rabbitmq", "localstack"}
    published = {}
    for name, service in services.items():
        assert isinstance(service["image"], str), name
        assert ":" in service["image"], f"{name}: pin a version"
        assert service["healthcheck"]["test"], name  # `up --wait` waits for it
        for port in service["ports"]:
            host, _outside, inside = port.split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond this machine"
            published[int(inside)] = name
    assert {5432: "postgres", 6379: "redis", 5672: "rabbitmq", 4566: "localstack"}.items() \
        <= published.items()
    for volume in services["postgres"].get("volumes", []):
        assert volume.split(":")[0] in compose["volumes"]


def test_localstack_matches_the_one_the_tests_run() -> None:
    root = load(ROOT / "compose.yaml")["services"]["localstack"]
    own = load(ROOT / "localstack" / "compose.yaml")["services"]["localstack"]
    assert root == own
    pinned = (ROOT / "localstack" / "requirements.txt").read_text()
    assert f"localstack-core[runtime]=={root['image'].split(':')[1]}" in pinned
