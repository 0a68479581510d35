"""The import graph of `aotriton_rt`: no circle, no `builder`, drivers at the bottom.

Every import counts, the ones inside functions too: a lazy import hides a circle from the
interpreter, not from a reader. The graph is read from the source with `ast`, so nothing here
runs the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import aotriton_rt

PACKAGE = Path(aotriton_rt.__file__).resolve().parent
ROOT = "aotriton_rt"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module that `name` imports anywhere in its source, relative imports resolved.

    `from m import x` names the submodule `m.x` when there is one, else `m` itself.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        graph[name] = _imports(name, path, known)
    return graph


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_import_graph_reader_sees_lazy_and_relative_imports():
    graph = _graph()
    # A relative import inside a function (aotriton_rt.__init__ resolves names through importlib,
    # so pick modules that import plainly).
    assert "aotriton_rt.errors" in graph["aotriton_rt.library"]
    assert "aotriton_rt.drivers" in graph["aotriton_rt.library"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_aotriton_rt_has_no_import_circle():
    cycle = _cycle(_internal(_graph()))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_aotriton_rt_never_imports_builder():
    offenders = {m: sorted(t for t in targets if t == "builder" or t.startswith("builder."))
                 for m, targets in _graph().items()}
    assert not {m: t for m, t in offenders.items() if t}


def test_drivers_import_nothing_above_them():
    # The lowest runtime layer: drivers may use each other and `errors`, nothing else of ours.
    allowed = ("aotriton_rt.drivers", "aotriton_rt.errors")
    graph = _internal(_graph())
    above = {m: sorted(t for t in targets if not t.startswith(allowed))
             for m, targets in graph.items() if m.startswith("aotriton_rt.drivers")}
    assert not {m: t for m, t in above.items() if t}
