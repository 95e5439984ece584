"""memra's package layering, read from the source with ``ast`` (issue 13).

- No import cycles among memra's modules. Every ``import`` statement counts, module level or
  inside a function (a lazy import still ties two modules together); an import of a package
  counts as an import of its ``__init__``, an import of ``pkg.mod`` (or ``from pkg import mod``)
  as one of that module. The implicit import of a parent package is not an edge.
- kernels/ imports nothing of memra above quant/ and kernels/.
- Model files import nothing from kernels/ (``grep kernels memra/models/*.py`` finds only prose).
- The GPU benches share their helpers through memra/bench/common.py, not through each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "memra"


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(module: str, base: str, level: int, is_pkg: bool) -> str:
    if level == 0:
        return module
    pkg = base.split(".") if is_pkg else base.split(".")[:-1]
    pkg = pkg[: len(pkg) - (level - 1)]
    return ".".join(pkg + ([module] if module else []))


def imports_of(name: str) -> set[str]:
    """The memra modules that module ``name`` imports anywhere in its source."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(node.module or "", name, node.level, is_pkg)
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # ``import memra.x.y`` of a non-module attribute
                t = t.rpartition(".")[0]
            if t.startswith("memra") and t != name:
                out.add(t)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), as sorted lists."""
    index, low, stack, on, comps, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_walk_sees_lazy_and_relative_imports():
    assert "memra.kernels.gemv" in GRAPH["memra.layers.linear"]
    assert "memra.layers.moe" in GRAPH["memra.models.step3p5"]
    assert "memra.models" in GRAPH["memra.engine.engine"]  # a package import: its __init__
    assert "memra.kernels.attention_decode" in GRAPH["memra.engine.cuda_graph"]  # inside a method


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_kernels_import_only_quant_and_kernels():
    bad = {m: sorted(t for t in ts if not t.startswith(("memra.kernels", "memra.quant")))
           for m, ts in GRAPH.items() if m.startswith("memra.kernels")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_models_import_nothing_from_kernels():
    bad = {m: sorted(t for t in ts if t.startswith("memra.kernels"))
           for m, ts in GRAPH.items() if m.startswith("memra.models")}
    assert {m: ts for m, ts in bad.items() if ts} == {}
    for p in (ROOT / "models").glob("*.py"):  # not even in code that is not an import statement
        tree = ast.parse(p.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "kernels" not in names and "gpu" not in names, p.name


def test_gpu_benches_share_helpers_through_common():
    benches = ["census", "moe_census", "moe_grouped", "moe_tune", "decode", "prefill"]
    entry_points = {("memra.bench.census", "memra.bench.moe_census"),  # census --moe-t runs the MoE curve
                    ("memra.bench.moe_grouped", "memra.bench.moe_tune")}  # moe-grouped --tune runs the tuner
    for b in benches:
        m = f"memra.bench.{b}"
        others = {t for t in GRAPH[m] if t.startswith("memra.bench.") and t != "memra.bench.common"}
        assert {(m, t) for t in others} <= entry_points, (m, others)
    assert not any(t.startswith("memra.bench.") for t in GRAPH["memra.bench.common"])
