"""The import directions of docs/architecture.md, read from the source (every `import`, also the
ones inside functions). A package may import only the packages listed for it; the config package
imports no torch (it is validated before torch is loaded). A failure names the file, the line and
the import."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "nxdt"

# package -> the nxdt packages it may import (lower layers). Everything not listed is forbidden.
_BASE = {"config", "spec", "device"}
ALLOWED = {
    "config": set(),
    "spec": {"config"},
    "device": {"config", "spec"},
    "hardware": _BASE,
    "models": _BASE,
    "precision": _BASE,
    "data": _BASE,
    "exp": _BASE,
    "parallel": _BASE | {"models", "precision"},
    "optim": _BASE | {"precision", "parallel"},
    "checkpoint": _BASE | {"exp", "models", "parallel", "precision", "optim"},
    "inference": _BASE | {"models", "precision", "parallel", "data", "checkpoint"},
    "planner": _BASE | {"hardware", "models", "precision", "parallel", "data"},
    "observability": _BASE | {"hardware", "models", "precision", "parallel", "data", "exp", "checkpoint",
                              "inference", "planner"},
    # online RL (GRPO): rollouts on the policy, rewards, its loss and step; the training loop plugs it in
    "rl": _BASE | {"models", "precision", "parallel", "inference", "data"},
    "training": _BASE | {"hardware", "models", "precision", "parallel", "optim", "data", "exp", "checkpoint",
                         "inference", "planner", "observability", "rl"},
    "tools": _BASE | {"hardware", "models", "precision", "parallel", "optim", "data", "exp", "checkpoint",
                      "inference", "planner", "observability", "rl", "training"},
    "cli": {"config", "spec", "tools", "training"},
}
HEAVY = ("torch", "lightning", "transformers", "numpy", "datasets", "safetensors", "tokenizers")
NO_HEAVY = {"config", "spec"}


def _imports(path: Path):
    """(line, imported module) for every import statement in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "nxdt":  # `from nxdt import device`
                for alias in node.names:
                    yield node.lineno, f"nxdt.{alias.name}"
            else:
                yield node.lineno, node.module


def _package(path: Path) -> str:
    first = path.relative_to(SRC).parts[0]
    return first[:-3] if first.endswith(".py") else first


def test_every_package_is_classified():
    packages = {_package(p) for p in SRC.rglob("*.py")} - {"__init__"}
    assert packages <= set(ALLOWED), f"add {sorted(packages - set(ALLOWED))} to ALLOWED (and docs/architecture.md)"


def test_imports_point_downward():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        pkg = _package(path)
        if pkg == "__init__":
            continue
        for line, module in _imports(path):
            parts = module.split(".")
            where = f"{path.relative_to(SRC.parent)}:{line}"
            if parts[0] == "nxdt" and len(parts) > 1 and parts[1] != pkg and parts[1] not in ALLOWED[pkg]:
                bad.append(f"{where}: nxdt.{pkg} must not import {module}")
            if pkg in NO_HEAVY and parts[0] in HEAVY:
                bad.append(f"{where}: nxdt.{pkg} must not import {module} (it runs before torch is loaded)")
    assert not bad, "imports against the architecture:\n" + "\n".join(bad)


def test_the_checker_sees_an_offending_import(tmp_path, monkeypatch):
    """The rule has teeth: a models file importing the training loop is reported with its line."""
    fake = tmp_path / "nxdt"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "bad.py").write_text("import os\n\ndef f():\n    from nxdt.training.module import x\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    try:
        test_imports_point_downward()
    except AssertionError as err:
        assert "models/bad.py:4: nxdt.models must not import nxdt.training.module" in str(err)
    else:
        raise AssertionError("the offending import was not reported")


def _doc_chunks(text: str) -> dict[str, str]:
    """docs/architecture.md cut at each package's heading (### `nxdt.X`) or table row (| `nxdt.X`)."""
    marks = sorted((m.start(), m.group(1)) for m in re.finditer(r"^(?:###|\|) `nxdt\.(\w+)`", text, re.M))
    return {name: text[start:end] for (start, name), (end, _) in zip(marks, [*marks[1:], (len(text), "")])}


def test_architecture_doc_names_every_package_and_module():
    """docs/architecture.md is the map: a package or module added without its line there fails here
    (each module is named in its own package's section or row)."""
    chunks = _doc_chunks((SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8"))
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        package = _package(path)
        if package == "__init__":
            continue
        if package not in chunks:
            missing.append(f"nxdt.{package}")
        elif rel.name != "__init__.py" and len(rel.parts) > 1 and f"`{rel.name}`" not in chunks[package]:
            missing.append(str(rel))
    assert not missing, "docs/architecture.md does not name: " + ", ".join(sorted(set(missing)))
