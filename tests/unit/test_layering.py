"""The import graph of src/shardtune follows the intended layering: no cycles, no arrow from a lower layer up.

Every import counts, also one inside a function (a hidden cycle is still a cycle); for the layering also one under
``if TYPE_CHECKING:``. Layers, lowest first; a package
may import its own layer's leaf modules and anything below, never above:

    errors, host, world, run_files, paths, arguments   leaves: the standard library only
    hub                              leaf: brings hub repositories into the cache (through huggingface_hub)
    versions                         leaf: installed versions and what differs between them (probes torch lazily)
    config                           keys, types, files of settings
    data                             datasets, templates, packing (takes DataSettings, never the config)
    model                            loading, adapters, architectures (never torch.distributed)
    optim                            optimizer settings and builders
    engines                          one module per engine, the engine plan
    estimate, export, infer          the memory model; checkpoints -> Hugging Face folders; chat, answer metrics
    train                            the loop and the run
    launch                           preflight, supervise, worker, schedulers
    web                              shardtune status and shardtune web: read run folders, serve the page
    cli                              the command
Entry modules (``__main__``) may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "shardtune"
LAYERS = [
    {"errors", "host", "world", "run_files", "paths", "startup_gc", "cpu_kernel_caches", "arguments", "versions",
     "hub"},
    {"config"},
    {"data"},
    {"model"},
    {"optim"},
    {"engines"},
    {"estimate", "export", "infer"},
    {"train"},
    {"launch"},
    {"web"},
    {"cli"},
]
RANK = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], *, typing_only: bool = True) -> set[str]:
    """shardtune modules ``path`` imports anywhere (``from shardtune.x import y`` names module x.y if it is one).
    ``typing_only``: also the imports under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    tree = ast.parse(path.read_text())
    skipped = set() if typing_only else {id(node) for block in ast.walk(tree) if _is_type_checking_block(block)
                                         for node in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("shardtune")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardtune"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return found


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def import_graph(*, typing_only: bool = True) -> dict[str, set[str]]:
    paths = sorted(SRC.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules, typing_only=typing_only) - {module_name(p)} for p in paths}


def unit_of(module: str) -> str:
    """The layering unit: the top-level package or leaf module under shardtune."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "shardtune"


def is_entry(module: str) -> bool:
    return module.endswith("__main__")


def test_every_package_has_a_layer():
    units = {unit_of(m) for m in import_graph()} - {"shardtune", "__main__"}
    assert units <= set(RANK), f"add these to LAYERS: {sorted(units - set(RANK))}"


def test_no_import_points_up_a_layer():
    upward = []
    for module, targets in import_graph().items():
        if is_entry(module) or module == "shardtune":
            continue
        for target in targets:
            if target != "shardtune" and RANK[unit_of(target)] > RANK[unit_of(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports from a lower layer up:\n" + "\n".join(sorted(upward))


def test_leaves_import_no_shardtune_module():
    graph = import_graph()
    leaves = [f"{m} -> {t}" for m in graph if unit_of(m) in LAYERS[0] for t in graph[m]]
    assert not leaves


def test_no_import_cycle():
    """Counting every import that runs (a function-level one too)."""
    graph = import_graph(typing_only=False)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_through_annotations():
    """Annotation-only imports cannot loop at run time, but a circle there is still two modules that each need the
    other to be read (the engine records and their registry once shared ``EnginePlan`` that way): none is allowed."""
    cycle = find_cycle(import_graph(typing_only=True))
    assert cycle is None, "import cycle (counting imports under TYPE_CHECKING): " + " -> ".join(cycle or [])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_model_and_data_never_import_torch_distributed():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if unit_of(module_name(path)) not in ("model", "data"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{module_name(path)}: {n}" for n in names if n.startswith("torch.distributed")]
    assert not offenders
