"""The package's layout as a checked rule, from its import graph (every import statement, at
module level or inside a function or an ``if TYPE_CHECKING`` block alike):

- no import cycle;
- nothing outside ``intellect_jax.testing`` (the simulation, fakes and fault injection) imports it;
- the coordinator (``intellect_jax.coordinator``) knows nothing of the node, the trainer or the
  model: a node depends on the coordinator's protocol and client, never the other way round
  (its command line, ``__main__``, is an entry point and may use the shared config errors).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "intellect_jax"


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from a import b`` means module ``a.b`` when that
    is a module, else ``a`` itself)."""
    files = {_module(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = graph.setdefault(mod, set())
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in node.names:
                    target = f"{base}.{a.name}"
                    if target in files:
                        deps.add(target)
                    elif base in files:
                        deps.add(base)
        deps.discard(mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


GRAPH = import_graph()


def test_the_graph_sees_the_package():
    assert "intellect_jax.coordinator.service" in GRAPH["intellect_jax.coordinator.server"]
    assert "intellect_jax.diloco.loop" in GRAPH["intellect_jax.diloco.node"]
    assert len(GRAPH) > 60


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer,forbidden", [
    ("intellect_jax", "intellect_jax.testing"),
    ("intellect_jax.coordinator", "intellect_jax.diloco"),
    ("intellect_jax.coordinator", "intellect_jax.trainer"),
    ("intellect_jax.coordinator", "intellect_jax.model"),
    ("intellect_jax.net", "intellect_jax.diloco"),
    ("intellect_jax.net", "intellect_jax.coordinator"),
])
def test_layering(layer, forbidden):
    def inside(mod: str, pkg: str) -> bool:
        return mod == pkg or mod.startswith(pkg + ".")

    bad = sorted(f"{m} imports {d}" for m, deps in GRAPH.items()
                 if inside(m, layer) and not inside(m, forbidden) and m != "intellect_jax.coordinator.__main__"
                 for d in deps if inside(d, forbidden))
    assert bad == []
