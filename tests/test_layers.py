"""The layering of src/ferry (issue 61), checked as `test_code_shape.py` checks sizes.

Each top-level part of ferry (a subpackage such as `ferry.train`, or a root module such as
`ferry.sharding`) is a node; an import anywhere in one part, at module level or inside a
function, of another part is an edge. The graph has no cycle, so every part stands on the parts
below it and never reaches back up. Named floors hold too: `ferry.xla` stands on `ferry.errors`
and `ferry.sharding` alone, and the config floor (`ferry.config`) imports none of the parts
that stand on it (`train`, `plan`, `run`).
"""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FERRY = SRC / "ferry"


def _part(module: str) -> str:
    """The top-level part of a dotted module name: `ferry.train.step` -> `ferry.train`."""
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Every ferry module `path` imports (absolute or relative, anywhere in the file)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from ferry import x`
    return {name for name in found if name.split(".")[0] == "ferry"}


def part_graph() -> dict[str, set[str]]:
    """Part -> the other parts it imports."""
    parts = {f"ferry.{p.stem if p.is_file() else p.name}" for p in FERRY.iterdir() if p.suffix == ".py" or p.is_dir()}
    parts -= {"ferry.__init__", "ferry.__pycache__"}
    graph: dict[str, set[str]] = defaultdict(set)
    for path in FERRY.rglob("*.py"):
        source = _part(_module_name(path))
        if source == "ferry":  # the package's own __init__ re-exports: it stands above everything
            continue
        graph[source] |= {_part(name) for name in _imported(path) if _part(name) in parts} - {source}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one part (Tarjan's walk)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _edges_within(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    return [f"{a} -> {b}" for a in group for b in sorted(graph[a]) if b in group]


def test_the_parts_of_ferry_form_no_cycle():
    graph = part_graph()
    assert len(graph) > 10, "expected ferry's parts under src/ferry"
    found = cycles(graph)
    assert not found, "parts of ferry import each other (break the tie that points up):\n" + "\n".join(
        "; ".join(_edges_within(graph, group)) for group in found
    )


def test_the_xla_floor_stands_on_errors_and_sharding_alone():
    assert part_graph()["ferry.xla"] <= {"ferry.errors", "ferry.sharding"}


def test_the_config_floor_imports_nothing_that_stands_on_it():
    above = {"ferry.train", "ferry.plan", "ferry.run"}
    assert not part_graph()["ferry.config"] & above
    assert all("ferry.config" in part_graph()[part] for part in above)


def test_a_cycle_is_found_and_named():
    """The walk the tests above rely on finds a cycle of three and leaves a chain alone."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def test_importing_ferry_and_its_config_defines_things_only():
    """No JAX_PLATFORMS set, no JAX backend started, nothing registered with Hydra: that happens
    where a run starts (the launchers, the benchmarks, `ferry.config.overrides.hydra_compose`)."""
    probe = (
        "import os, sys\n"
        "os.environ.pop('JAX_PLATFORMS', None)\n"
        "import ferry, ferry.config, ferry.config.train, ferry.offload, ferry.head, ferry.hf\n"
        "from hydra.core.config_store import ConfigStore\n"
        "from jax._src import xla_bridge\n"
        "registered = [name for name in ConfigStore.instance().repo if name.startswith('train')]\n"
        "print(os.environ.get('JAX_PLATFORMS'), registered, xla_bridge.backends_are_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[-2] == "None [] False", result.stdout + result.stderr
