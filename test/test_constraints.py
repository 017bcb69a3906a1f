"""The install pins every dependency (``python/constraints.txt``): a new PyPI release must not
change what CI installs (session 23's CI failed on one: transformers 5.25)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYTHON = Path(__file__).resolve().parents[1] / "python"


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: not an exact pin: {line!r}"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_every_dependency_of_the_main_venv_is_pinned_and_installed_at_its_pin() -> None:
    project = tomllib.loads((PYTHON / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pins = _pins(PYTHON / "constraints.txt")
    names = {_name(r) for r in wanted} - {"torch"}  # torch: the Makefile's TORCH
    assert names <= pins.keys(), f"not in python/constraints.txt: {sorted(names - pins.keys())}"
    for name in names:
        assert metadata.version(name) == pins[name], f"{name}: refresh the venv (make install)"


def test_torch_is_left_to_the_makefile_and_sglang_is_pinned() -> None:
    for path in (PYTHON / "constraints.txt", PYTHON / "constraints-sglang.txt"):
        pins = _pins(path)
        assert "torch" not in pins and "torchvision" not in pins, path.name
    assert _pins(PYTHON / "constraints-sglang.txt")["sglang"] == "0.5.23"
