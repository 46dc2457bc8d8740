"""No import circle in ``vlkv``: between modules, and between the runtime's packages (``kv/``,
``policies/``, ``link/``, ``store/``, ...) and its top-level modules (e.g. ``kv/`` and ``cache.py``).

Every import counts, lazy (inside a function) and type-only ones included: a circle that only works
because one side imports late is still two modules that each need the other. The graph is read from
the source (``ast``), so the test imports nothing it checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vlkv

ROOT = Path(vlkv.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``vlkv`` modules ``name`` imports anywhere in its source."""

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            r = resolve(t)
            if r is not None and r != name and r.startswith("vlkv"):
                found.add(r)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with each runtime sub-package (``vlkv.runtime.kv``, ...) as one node."""

    def node(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:3]) if m.startswith("vlkv.runtime.") and len(parts) > 3 else m

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(node(a), set()).update(node(b) for b in targets if node(b) != node(a))
    return out


def test_the_graph_sees_the_cache_modules():
    graph = _graph()
    assert graph["vlkv.runtime.kv.layer"] >= {"vlkv.runtime.kv.appends", "vlkv.runtime.kv.edits"}
    assert "vlkv.runtime.kv.entries" in graph["vlkv.runtime.kv.appends"]
    assert graph["vlkv.runtime.cache"] >= {"vlkv.runtime.kv.layer", "vlkv.runtime.kv.cache"}


def test_no_module_imports_itself_through_others():
    assert _cycles(_graph()) == []


def test_no_runtime_package_imports_itself_through_others():
    # e.g. kv/ importing runtime/cache.py while cache.py imports kv/
    assert _cycles(_packages(_graph())) == []


def test_the_cycle_finder_finds_two_and_three_cycles():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    packed = _packages(
        {"vlkv.runtime.kv.x": {"vlkv.runtime.cache"}, "vlkv.runtime.cache": {"vlkv.runtime.kv.y"}}
    )
    assert _cycles(packed) == [["vlkv.runtime.cache", "vlkv.runtime.kv"]]
