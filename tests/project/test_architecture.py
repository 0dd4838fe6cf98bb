"""The tree's shape, checked: layers import only downward (cli → harness → models / hf →
cache → attention → formats → errors, pdl), no import cycles, no private names imported
across modules, no source file over 500 lines. (That production code never imports the
reference oracle is checked in tests/attention/test_reference.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kvtax"
# The layer of each top-level room: a module may import its own layer or lower ones.
LAYERS = {"cli": 6, "harness": 5, "models": 4, "hf": 4, "cache": 3, "attention": 2,
          "formats": 1, "errors": 0, "pdl": 0, "__init__": 3, "__main__": 7}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()
assert len(MODULES) > 50, f"found only {len(MODULES)} modules under {SRC}"


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every kvtax import in the file."""
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kvtax":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in MODULES else base
                found.append((target, "" if target == full else alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("kvtax")]
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_layers_import_downward():
    bad = [f"{a}:{line} imports {b}" for a, edges in GRAPH.items() for b, _, line in edges
           if b in MODULES and _layer(b) > _layer(a)]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = {a: {b for b, _, _ in edges if b in MODULES and b != a and not _is_parent(b, a)}
             for a, edges in GRAPH.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _is_parent(package: str, module: str) -> bool:
    """A package's __init__ re-exporting its children is not a cycle with them."""
    return module.startswith(package + ".")


def test_no_private_names_across_modules():
    bad = [f"{a}:{line} imports {name} from {b}" for a, edges in GRAPH.items()
           for b, name, line in edges
           if name.startswith("_") and not name.startswith("__")]
    assert not bad, "private names crossing a module boundary:\n" + "\n".join(bad)


def test_source_files_stay_small():
    big = {str(p.relative_to(SRC.parent)): n for p in MODULES.values()
           if (n := p.read_text().count("\n")) > MAX_LINES}
    assert not big, f"files over {MAX_LINES} lines (split them by job): {big}"
