"""The package's import graph: no cycles, and the layers import only downwards.

Every `import` / `from ... import` in treeflash/ is read with `ast` (those inside functions too: a
cycle through a deferred import is still a cycle a reader has to untangle), relative imports
resolved; imports under `if TYPE_CHECKING:` are left out (they never run). Layers, bottom up:

  0. options, errors, fsutil, config, datasets   the names, checks and prompts every layer shares
  1. models/                           target, drafter, caches, checkpoints (never decoding/)
  2. decoding/                         proposers, trees, the decode loop
  3. api                               Engine, load()
  4. cli*, bench/, serve/, training/, the package's __init__ / __main__   entry points
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "treeflash"
LAYERS = [
    ("treeflash.options", "treeflash.errors", "treeflash.fsutil", "treeflash.config", "treeflash.datasets"),
    ("treeflash.models",),
    ("treeflash.decoding",),
    ("treeflash.api",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST):
    """Every node, but not the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports(name: str, path: Path, modules: set[str], typing: bool = False) -> set[str]:
    """The treeflash modules `name` imports (a name imported from a package counts as its submodule
    when there is one, else as the package); typing: those under `if TYPE_CHECKING:` too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if typing else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out.add(f"{base}.{a.name}")
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(name, path, set(paths), typing) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layer(name: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS)  # the entry points


def test_the_graph_reads_every_module():
    graph = import_graph()
    assert {"treeflash.api", "treeflash.models.target", "treeflash.serve.worker"} <= set(graph)
    assert "treeflash.models.target" in graph["treeflash.api"]
    # deferred (in-function) imports count: cli_generate imports the API's loader inside `run`
    assert "treeflash.cli" in graph["treeflash.cli_generate"]


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_has_no_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (counting imports inside functions): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_layers_import_only_downwards():
    """options/errors/config at the bottom, then models/, decoding/, api; models/ and decoding/ never
    import api, cli, bench, serve or training."""
    bad = [f"{name} -> {dep}" for name, deps in sorted(import_graph().items()) for dep in sorted(deps)
           if layer(dep) > layer(name)]
    assert not bad, "upward imports: " + ", ".join(bad)


def test_training_does_not_import_bench():
    """Training reads the prompts from treeflash/datasets.py, shared with bench/, never from bench/."""
    graph = import_graph()
    bad = [f"{name} -> {dep}" for name, deps in sorted(graph.items()) if name.startswith("treeflash.training")
           for dep in sorted(deps) if dep.startswith("treeflash.bench")]
    assert not bad, "training imports bench: " + ", ".join(bad)


def test_drafter_and_its_checkpoint_files_do_not_import_each_other():
    """models/drafter.py reads and writes checkpoints through models/drafter_io.py, which types the
    drafter with `drafter_config.DrafterWeights`: no import back, not even for type checking."""
    graph = import_graph(typing=True)
    assert "treeflash.models.drafter_io" in graph["treeflash.models.drafter"]
    assert "treeflash.models.drafter" not in graph["treeflash.models.drafter_io"]
