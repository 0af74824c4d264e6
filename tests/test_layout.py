"""The house in wings, measured: the import graph of toolkit/ with each flat module and each wing (subpackage) as
one node, every import counted (module level and inside functions; `if TYPE_CHECKING:` blocks are not imports).
Imports run one way, down the layer order of docs (DESIGN.md, "Layout: the house in wings"):

    cli -> commands -> run, check -> train, engines -> estimate, emit -> plan, patches -> inputs -> ground

`python tests/test_layout.py` prints the numbers (nodes, layers, edges, upward imports, circles, line counts)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "toolkit"
GROUND = ("__init__", "errors", "bounds", "paths", "fileio", "processes", "cache")
LAYERS: dict[str, int] = {**{name: 0 for name in GROUND}, "inputs": 1, "plan": 2, "patches": 2, "estimate": 3, "emit": 3,
                          "engines": 4, "train": 4, "check": 5, "run": 5, "api": 5, "commands": 6, "cli": 7, "__main__": 7}
"""Each node's place in the layer order; an import from a lower number to a higher one runs back up."""


def _node(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "toolkit":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(tree: ast.AST, module: str):
    """Every toolkit module `tree` imports, outside `if TYPE_CHECKING:` blocks."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = module.split(".")[:-node.level] if not module.endswith("__init__") else \
                    module.split(".")[:-(node.level - 1) or None]
                base = ".".join(package + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # `from toolkit import cache`


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts)] = path
    return out


def graph() -> dict[str, set[str]]:
    """node -> the nodes it imports (itself excluded)."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        source = _node(module)
        edges.setdefault(source, set())
        for imported in _imports(ast.parse(path.read_text()), module):
            if imported in known or f"{imported}.__init__" in known:
                target = _node(imported)
                if target and target != source:
                    edges[source].add(target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def depth(edges: dict[str, set[str]]) -> int:
    """Layers: the longest chain of imports, counted in nodes (the graph has no circles)."""
    memo: dict[str, int] = {}

    def level(v: str) -> int:
        if v not in memo:
            memo[v] = 0
            memo[v] = 1 + max((level(w) for w in edges.get(v, ())), default=0)
        return memo[v]

    return max(level(v) for v in edges)


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if LAYERS[a] < LAYERS[b])


def numbers() -> dict:
    edges = graph()
    return {"nodes": len(edges), "layers": depth(edges), "edges": sum(len(t) for t in edges.values()),
            "upward": upward(edges), "circles": circles(edges),
            "flat modules": sorted(p.stem for p in PACKAGE.glob("*.py")),
            "cli.py lines": len((PACKAGE / "cli.py").read_text().splitlines()),
            "longest module": max((len(p.read_text().splitlines()), str(p.relative_to(PACKAGE)))
                                  for p in PACKAGE.rglob("*.py"))}


def test_every_node_has_a_place_in_the_layer_order():
    assert set(graph()) <= set(LAYERS), set(graph()) - set(LAYERS)


def test_no_import_circles():
    assert circles(graph()) == []


def module_graph() -> dict[str, set[str]]:
    """module -> the toolkit modules it imports, lazy imports inside functions included (a folder is no node)."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for module, path in known.items():
        edges.setdefault(module, set())
        for imported in _imports(ast.parse(path.read_text()), module):
            target = imported if imported in known else f"{imported}.__init__"
            if target in known and target != module:
                edges[module].add(target)
    return edges


def test_no_import_circles_between_modules_inside_a_wing_either():
    assert circles(module_graph()) == []


def test_at_most_one_import_runs_back_up_the_layers():
    assert len(upward(graph())) <= 1, upward(graph())


def test_a_dozen_modules_at_most_flat_in_the_package():
    flat = [p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(flat) <= 12, flat


def test_cli_is_thin_and_no_module_is_long():
    assert len((PACKAGE / "cli.py").read_text().splitlines()) < 200
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_every_wing_says_what_it_owns():
    for wing in (p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((wing / "__init__.py").read_text()))
        assert doc and len(doc) > 60, f"toolkit/{wing.name}/__init__.py needs a docstring saying what it owns"


def test_the_runtime_folder_never_feeds_the_grid_and_the_launcher_never_loads_the_search():
    known = modules()

    def imported_by(module: str) -> set[str]:
        return set(_imports(ast.parse(known[module].read_text()), module))

    assert not {m for m in imported_by("toolkit.inputs.grid") if m.startswith("toolkit.train")}
    for module in ("toolkit.run.launcher", "toolkit.run.preflight", "toolkit.commands.launch"):
        assert not {m for m in imported_by(module) if m.startswith("toolkit.estimate")}, module


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_building_the_parser_imports_no_more_work_than_before_the_move():
    """`toolkit --help` loads the command modules (flags only) and, outside them, the same toolkit modules as before
    the wings (toolkit, bounds, errors, cli, and choices / job / lora / strategy for the flags' choices) and
    toolkit.processes (how a toolkit process starts and ends: the standard library only, since 9110a6a); never torch,
    transformers, pydantic or the engines."""
    import subprocess
    import sys

    code = ("import sys; from toolkit.cli import build_parser; build_parser(); "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('toolkit', 'torch', 'transformers', 'pydantic', 'deepspeed', 'accelerate', 'yaml'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=PACKAGE.parent).stdout.split())
    assert {m for m in loaded if not m.startswith("toolkit.commands")} == {
        "toolkit", "toolkit.bounds", "toolkit.cli", "toolkit.errors", "toolkit.inputs", "toolkit.inputs.choices",
        "toolkit.inputs.job", "toolkit.inputs.lora", "toolkit.inputs.strategy", "toolkit.processes"}


if __name__ == "__main__":
    for key, value in numbers().items():
        print(f"{key}: {value}")
