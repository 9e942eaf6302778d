"""The package installs and imports on a fresh machine: every module imports, and every
third-party module it imports is declared in pyproject.toml (a module installed by hand once
made CI green while `pip install -e .` failed for every new user)."""

import ast
import importlib
import importlib.metadata as md
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

import pytest

import intellect_jax

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "intellect_jax"
MODULES = sorted(m.name for m in pkgutil.walk_packages(intellect_jax.__path__, "intellect_jax."))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _declared() -> dict[str, str]:
    """Normalized distribution name -> its requirement string, core deps and every extra."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"]) + [r for v in proj["optional-dependencies"].values() for r in v]
    return {_norm(re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0]): r for r in reqs}


def third_party_imports(root: Path = PKG) -> dict[str, set[str]]:
    """Top-level module names imported anywhere under `root` (function bodies included) that
    are neither stdlib nor the package itself -> the files importing them."""
    found: dict[str, set[str]] = {}
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top != "intellect_jax":
                    found.setdefault(top, set()).add(str(f.relative_to(root)))
    return found


def distribution_of(module: str) -> str:
    """The installed distribution providing a top-level module (its own name if not installed,
    e.g. a GPU-only module guarded by try/except)."""
    dists = md.packages_distributions().get(module, [])
    return _norm(dists[0]) if dists else _norm(module)


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports(name):
    importlib.import_module(name)


def test_modules_found():
    # the walk sees the whole tree (a broken walk would make the test above vacuous)
    files = {p for p in PKG.rglob("*.py")}
    assert len(MODULES) >= len(files) - 1 and "intellect_jax.diloco.node" in MODULES


def test_third_party_imports_are_declared():
    declared = _declared()
    imports = third_party_imports()
    assert {"jax", "numpy", "tyro"} <= set(imports)  # the scan sees real imports
    missing = {m: sorted(files) for m, files in imports.items() if distribution_of(m) not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_declared_dependency_has_a_lower_bound():
    loose = [r for r in _declared().values() if ">=" not in r and "==" not in r]
    assert not loose, f"declare a tested lower bound for: {loose}"


def test_the_scan_catches_an_undeclared_import(tmp_path):
    (tmp_path / "mod.py").write_text("def f():\n    import some_unlisted_lib.sub\n    from os import path\n")
    imports = third_party_imports(tmp_path)
    assert set(imports) == {"some_unlisted_lib"}
    assert distribution_of("some_unlisted_lib") not in _declared()
