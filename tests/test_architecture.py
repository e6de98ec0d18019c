"""The architecture as a test: every module's imports against the layering, and no import cycle.

Layers, top to bottom (docs/ARCHITECTURE.md): a module imports its own layer, the layer directly
below it and the leaves. Leaves import nothing of ours but other leaves; every layer but
kernels may import them. tools/ may import anything; tests/ are not read. An import counts
where it runs, at module level or inside a function (a lazy import is still an arrow); one
under `if TYPE_CHECKING:` never runs and does not count.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]  # the package `deltaserve` (pyproject's package-dir)

# ---- the rules -----------------------------------------------------------------------------
LAYERS = ("http", "engine", "ipc", "rank", "kernels")  # top to bottom
FOLDERS = {  # package -> its layer (the longest match wins: engine.rank is rank, not engine)
    "deltaserve.http": "http",
    "deltaserve.engine": "engine",
    "deltaserve.ipc": "ipc",
    "deltaserve.engine.rank": "rank",
    "deltaserve.kernels": "kernels",
}
LEAVES = {  # module or package -> what it is
    "deltaserve": "the package root: the version",
    "deltaserve.ipc.messages": "the wire schema",
    "deltaserve.engine.model_config": "the checkpoint's config reader",
    "deltaserve.engine.speculative_config": "speculative decoding's settings, read on both sides",
    "deltaserve.engine.checkpoint_files": "the checkpoint's files and headers",
    "deltaserve.engine.guided": "guided decoding's algorithms (a package)",
    "deltaserve.engine.vision_config": "the checkpoint's vision config reader",
    "deltaserve.engine.encoder_cache": "which encodings are held, run alike on both sides",
}
NO_LEAVES = {"kernels"}  # layers that may not import even the leaves: kernels import kernels
FREE = {"deltaserve.tools"}  # may import anything
NOT_PACKAGES = {"tests", "docs", "bench", "build", "dist", "__pycache__"}  # folders not read

# Work in flight on other branches of issue 49's second wave: the lead empties these at merge
# (test_in_flight_still_there fails once one is gone).
IN_FLIGHT_ARROWS: set[tuple[str, str]] = set()  # (module, import); none left
IN_FLIGHT_CYCLES: set[frozenset[str]] = set()  # none left


# ---- reading the imports -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Import:
    target: str  # the module imported (`from package import module` names the module)
    line: int


def modules_of(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`, by name (not tests/, docs/ or bench/)."""
    found = {}

    def walk(folder: Path, package: str) -> None:
        for path in sorted(folder.iterdir()):
            if path.is_dir() and not _skipped(path.name):
                walk(path, f"{package}.{path.name}")
            elif path.suffix == ".py":
                found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path

    walk(root, "deltaserve")
    return found


def _skipped(folder: str) -> bool:
    return folder in NOT_PACKAGES or folder.startswith(".") or folder.endswith(".egg-info")


def read_imports(root: Path) -> dict[str, list[Import]]:
    """Each module's imports of our own modules, as they run (not TYPE_CHECKING ones)."""
    modules = modules_of(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    stack = list(ast.parse(path.read_text(), str(path)).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack += node.orelse
            continue
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append(Import(full if full in modules else base, node.lineno))
        stack += ast.iter_child_nodes(node)
    ours = {i for i in found if i.target == "deltaserve" or i.target.startswith("deltaserve.")}
    return sorted(ours, key=lambda i: (i.line, i.target))


# ---- the checks ----------------------------------------------------------------------------
def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_leaf(module: str) -> bool:
    """A declared leaf or a module of a leaf package (the root is a leaf module, not package)."""
    return module in LEAVES or any(_within(module, leaf) for leaf in LEAVES if leaf != "deltaserve")


def layer_of(module: str) -> str | None:
    matches = [package for package in FOLDERS if _within(module, package)]
    return FOLDERS[max(matches, key=len)] if matches else None


def is_free(module: str) -> bool:
    return any(_within(module, free) for free in FREE)


def may_import(module: str, target: str) -> bool:
    if is_free(module):
        return True
    if is_leaf(module):
        return is_leaf(target)
    layer = layer_of(module)
    if layer is None:  # test_every_module_has_a_place names it
        return True
    if is_leaf(target):
        return layer not in NO_LEAVES
    return layer_of(target) in _own_and_below(layer)


def _own_and_below(layer: str) -> tuple[str, ...]:
    at = LAYERS.index(layer)
    return LAYERS[at : at + 2]


def wrong_arrows(graph: dict[str, list[Import]]) -> list[str]:
    """One line per import against the layering, naming the module, its line and the import."""
    return [
        f"{module} (line {i.line}) imports {i.target}: {layer_of(module) or 'a leaf'} may "
        f"import {_allowed(module)}"
        for module, imports in sorted(graph.items())
        for i in imports
        if not may_import(module, i.target) and (module, i.target) not in IN_FLIGHT_ARROWS
    ]


def _allowed(module: str) -> str:
    if is_leaf(module):
        return "only leaves"
    layer = layer_of(module)
    names = [*_own_and_below(layer), *([] if layer in NO_LEAVES else ["the leaves"])]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def import_cycles(graph: dict[str, list[Import]]) -> list[str]:
    """One line per import cycle (a strongly connected group of modules): a loop through it,
    each module with the line of its import of the next."""
    digraph = import_digraph(graph)
    lines = []
    for group in sorted(map(sorted, nx.strongly_connected_components(digraph))):
        first = group[0]
        if len(group) == 1 and not digraph.has_edge(first, first):
            continue  # a module alone, not importing itself
        if frozenset(group) in IN_FLIGHT_CYCLES:
            continue
        loop = nx.find_cycle(digraph.subgraph(group), source=first)
        steps = [f"{a} line {digraph.edges[a, b]['line']}" for a, b in loop]
        lines.append(f"import cycle: {' -> '.join(steps)} -> {loop[-1][1]}")
    return lines


def import_digraph(graph: dict[str, list[Import]]) -> nx.DiGraph:
    """Modules and their imports of each other, each edge with its first import's line."""
    digraph = nx.DiGraph()
    digraph.add_nodes_from(graph)
    for module, imports in graph.items():
        for i in imports:
            if i.target in graph and not digraph.has_edge(module, i.target):
                digraph.add_edge(module, i.target, line=i.line)
    return digraph


# ---- the tree as it is ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return read_imports(ROOT)


def test_layering(graph: dict[str, list[Import]]) -> None:
    """http -> engine -> ipc -> rank -> kernels, and the leaves: no arrow against it."""
    wrong = wrong_arrows(graph)
    assert not wrong, "\n" + "\n".join(wrong)


def test_no_import_cycles(graph: dict[str, list[Import]]) -> None:
    cycles = import_cycles(graph)
    assert not cycles, "\n" + "\n".join(cycles)


def test_every_module_has_a_place(graph: dict[str, list[Import]]) -> None:
    """Each module is in a layer's folder, a leaf, or free (tools/): a new top-level folder
    or module must say which."""
    assert [m for m in graph if layer_of(m) is None and not is_leaf(m) and not is_free(m)] == []


def test_leaves_import_only_leaves(graph: dict[str, list[Import]]) -> None:
    """Every declared leaf exists and imports nothing of ours but leaves."""
    assert set(LEAVES) <= graph.keys()
    for module, imports in graph.items():
        if is_leaf(module):
            assert [i.target for i in imports if not is_leaf(i.target)] == [], module


def test_in_flight_still_there(graph: dict[str, list[Import]]) -> None:
    """An exemption whose arrow or cycle is gone must go too: the lists only shrink."""
    arrows = {(module, i.target) for module, imports in graph.items() for i in imports}
    assert IN_FLIGHT_ARROWS <= arrows, "remove from IN_FLIGHT_ARROWS what is gone"
    groups = set(map(frozenset, nx.strongly_connected_components(import_digraph(graph))))
    assert IN_FLIGHT_CYCLES <= groups, "remove from IN_FLIGHT_CYCLES what is gone"


def test_every_package_is_in_pyproject() -> None:
    """A folder of modules missing from pyproject's explicit package list is left out of the
    wheel (an editable install would not show it)."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    modules = modules_of(ROOT)
    folders = {
        name if path.name == "__init__.py" else name.rpartition(".")[0]
        for name, path in modules.items()
    }
    assert folders == set(listed)


# ---- the checker fails where it should -----------------------------------------------------
def test_engine_importing_rank_code_fails(graph: dict[str, list[Import]]) -> None:
    """The issue's example, on the real tree with one import added: the scheduler reaching for
    the rank's executor is named, with its line."""
    wrong = {**graph, "deltaserve.engine.scheduler": [*graph["deltaserve.engine.scheduler"]]}
    wrong["deltaserve.engine.scheduler"].append(Import("deltaserve.engine.rank.executor", 999))
    assert set(wrong_arrows(wrong)) - set(wrong_arrows(graph)) == {
        "deltaserve.engine.scheduler (line 999) imports deltaserve.engine.rank.executor: "
        "engine may import engine, ipc and the leaves"
    }


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_small_tree(tmp_path: Path) -> None:
    """Read from source: a lazy import counts, a TYPE_CHECKING one does not, a relative one
    resolves, `from package import module` names the module; wrong arrows and a cycle found."""
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/model_config.py": "",
            "engine/scheduler.py": (
                "from typing import TYPE_CHECKING\n"
                "from deltaserve.engine import model_config\n"
                "from . import request\n"
                "if TYPE_CHECKING:\n"
                "    from deltaserve.kernels.rope import KVStore\n"
                "def load():\n"
                "    from deltaserve.engine.rank import loader\n"
            ),
            "engine/request.py": "def later():\n    import deltaserve.engine.scheduler\n",
            "engine/rank/__init__.py": "",
            "engine/rank/loader.py": "from deltaserve.kernels.rope import KVStore\n",
            "kernels/__init__.py": "",
            "kernels/rope.py": "from deltaserve.engine.model_config import ModelConfig\n",
            "tests/test_x.py": "from deltaserve.http.serve import main\n",
        },
    )
    graph = read_imports(tmp_path)
    assert graph["deltaserve.engine.scheduler"] == [
        Import("deltaserve.engine.model_config", 2),
        Import("deltaserve.engine.request", 3),
        Import("deltaserve.engine.rank.loader", 7),
    ]
    assert wrong_arrows(graph) == [
        "deltaserve.engine.scheduler (line 7) imports deltaserve.engine.rank.loader: "
        "engine may import engine, ipc and the leaves",
        "deltaserve.kernels.rope (line 1) imports deltaserve.engine.model_config: "
        "kernels may import kernels",
    ]
    assert import_cycles(graph) == [
        "import cycle: deltaserve.engine.request line 2 -> deltaserve.engine.scheduler line 3 "
        "-> deltaserve.engine.request"
    ]
