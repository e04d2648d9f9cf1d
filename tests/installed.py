"""How duebox is installed in this environment, for the tests.

An editable install (``pip install -e .``) is a link tree under ``build/``
(pyproject.toml: ``[tool.distutils.editable_wheel] mode = "strict"``), so
that type checkers find the package through a plain ``.pth`` path.  A link
tree links the files that existed at install time: a module added since is
missing from it until ``pip install -e .`` runs again.
"""

from __future__ import annotations

import json
import site
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def editable_paths() -> list[Path] | None:
    """The directories the editable install's ``.pth`` adds to ``sys.path``
    (None when duebox is not installed editable)."""
    # Where it is installed, not the duebox.egg-info a build leaves in the
    # repository (the working directory is on sys.path too).
    found = list(metadata.distributions(name="duebox", path=site.getsitepackages()))
    if not found:
        return None
    dist = found[0]
    direct = dist.read_text("direct_url.json")
    if not direct or not json.loads(direct).get("dir_info", {}).get("editable"):
        return None
    paths: list[Path] = []
    for file in dist.files or []:
        if file.name.endswith(".pth"):
            for line in Path(str(file.locate())).read_text().splitlines():
                if line.strip() and not line.startswith(("#", "import ")):
                    paths.append(Path(line.strip()))
    return paths


def missing_links() -> list[str]:
    """Source files of the package that an editable link tree lacks."""
    paths = editable_paths()
    if not paths:
        return []
    tree = next((p / "duebox" for p in paths if (p / "duebox").is_dir()), None)
    if tree is None:
        return []
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    missing = []
    for package, folder in setuptools["package-dir"].items():
        target = tree.joinpath(*package.split(".")[1:])
        for src in sorted((ROOT / folder).rglob("*.py")):
            relative = src.relative_to(ROOT / folder)
            if "__pycache__" not in relative.parts and not (target / relative).exists():
                missing.append(f"{folder}/{relative}")
    return missing
