"""The import graph of agentenv/ has no cycles between its packages.

Built from the source with `ast` (nothing is imported): every `import` / `from ... import` at any
depth counts, a function-local one too (a lazy import hides a cycle, it does not remove it); only
imports under `if TYPE_CHECKING:` are left out (they never run). A package is `agentenv.<name>`
(a subpackage, or a top-level module such as `agentenv.models`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "agentenv"


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m in known}


def module_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, targets in module_graph().items():
        src = _package(mod)
        graph.setdefault(src, set())
        for t in targets:
            dst = _package(t)
            if dst != src and dst != "agentenv":
                graph[src].add(dst)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        n = stack.pop()
                        on_stack.discard(n)
                        comp.append(n)
                        if n == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_graph_sees_known_edges() -> None:
    """Guard against a graph that finds nothing (and so no cycle): edges we know exist are there."""
    g = package_graph()
    assert "agentenv.state" in g["agentenv.orchestrator"]
    assert "agentenv.network" in g["agentenv.runtimes"]
    assert "agentenv.orchestrator" in g["agentenv.server"]  # a function-local import counts


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_cycles_between_packages() -> None:
    found = cycles(package_graph())
    assert found == [], f"import cycles between packages of agentenv/: {found}"


def test_no_cycles_between_orchestrator_modules() -> None:
    """The orchestrator's parts (host, lifecycle, admission, warm, catalog, routing, templates...)
    import each other one way only."""
    graph = {m: {t for t in ts if t.startswith("agentenv.orchestrator.")}
             for m, ts in module_graph().items() if m.startswith("agentenv.orchestrator.")}
    found = cycles(graph)
    assert found == [], f"import cycles between modules of agentenv.orchestrator: {found}"


def _state_writes(path: Path) -> list[int]:
    """Lines of `<expr>.state = ...` (plain, tuple or augmented assignment targets)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr == "state" and isinstance(sub.ctx, ast.Store):
                    lines.append(node.lineno)
    return lines


def test_only_lifecycle_writes_a_sandbox_state() -> None:
    lifecycle = ROOT / "orchestrator" / "lifecycle.py"
    assert _state_writes(lifecycle), "the check finds nothing: lifecycle.py itself writes states"
    writers = {str(p.relative_to(ROOT.parent)): lines for p in sorted(ROOT.rglob("*.py"))
               if p != lifecycle and (lines := _state_writes(p))}
    assert writers == {}, f"sandbox states written outside orchestrator/lifecycle.py: {writers}"
