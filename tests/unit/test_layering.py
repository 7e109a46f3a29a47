"""No import circles, at file or package level, and every package imports only the layers below
it (docs/design.md, "Layers"). Read from the source with ``ast``: every import statement counts,
also those inside functions and under ``TYPE_CHECKING``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# lowest first; a package may import its own layer's modules only within itself
LAYERS = [("pdserve",), ("kv_transfer",), ("prefill_worker", "decode_worker", "router"), ("pdserve_app",)]
PACKAGES = [p for layer in LAYERS for p in layer]
# what the engine may import from the rest of pdserve: leaf modules only (no config, workers, transports)
ENGINE_MAY_IMPORT = {"pdserve.errors", "pdserve.kv_layout", "pdserve.messages", "pdserve.sampling", "pdserve.structured"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (a name's longest prefix that is a module)."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name)
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():  # the checks below are not vacuous: known edges are found
    graph = import_graph()
    assert "kv_transfer.lease" in graph["kv_transfer.base"]
    assert "pdserve.engine.engine" in graph["pdserve.worker"]
    assert "prefill_worker" in graph["pdserve_app.deploy"]  # an import inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_between_files():
    assert cycles(import_graph()) == []


def test_packages_import_only_lower_layers():
    layer_of = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    wrong = []
    for mod, targets in import_graph().items():
        here = mod.split(".")[0]
        for target in targets:
            there = target.split(".")[0]
            if there != here and layer_of[there] >= layer_of[here]:
                wrong.append(f"{mod} -> {target}")
    assert wrong == []


def test_the_engine_imports_only_leaf_modules_of_pdserve():
    wrong = [f"{mod} -> {target}" for mod, targets in import_graph().items() if mod.startswith("pdserve.engine")
             for target in targets if not target.startswith("pdserve.engine") and target not in ENGINE_MAY_IMPORT]
    assert wrong == []
