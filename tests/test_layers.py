"""The import graph follows the data flow (README, Architecture): no circle, nothing imports upward.

Every module of the package sits in one layer; a module may import its own layer and the layers
before it, never a later one -- imports inside functions included (a lazy import is a dependency
too). A new module must be placed here, which is the point: its place in the flow is decided.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoaccum"

LAYERS: list[tuple[str, ...]] = [
    # plain values and rules used everywhere
    ("errors", "units", "validate", "oom", "jsonio", "log", "state"),
    # memory: meters, capacity, the budget; precision
    ("memory.meter", "memory.cuda", "memory.tracked", "memory.capacity", "memory", "precision", "recovery"),
    ("memory_model",),
    # what a step is: batches, tasks, the plan
    ("batch", "task", "plan", "batchnorm", "lengths"),
    # measure -> model -> plan
    ("report", "cache", "estimate", "stepper", "size_search", "length_search", "probe"),
    # cut -> accumulate -> guard
    ("data", "sync", "cut", "distributed.settle", "distributed.process_group", "distributed.models",
     "distributed.fsdp2", "distributed.overlap", "distributed.ddp", "distributed"),
    ("accumulate", "regrow", "policy", "growth", "cut_agreement", "step_input", "step_result", "optim_step",
     "losses", "guard_args"),
    ("guard",),
    # the trainer and its components
    ("lr", "checkpoint", "training.config", "training.evaluate", "training.progress", "training.resume",
     "training.plans", "training.loop", "training", "fit"),
    # inside other trainers: HF Trainer, Lightning, Accelerate (each imports its framework itself)
    ("integrations.lazy_guard", "integrations.transformers", "integrations.lightning", "integrations.accelerate",
     "integrations"),
    # search on top
    ("knobs", "throughput", "search.space", "search.compare", "search.result", "search.study", "search"),
    # the entry points
    ("demo", "plot", "cli", "__main__", ""),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    """The autoaccum modules ``path`` imports (anywhere in it), as names relative to the package."""
    found: set[str] = set()
    package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "autoaccum"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = package_of.split(".") if package_of else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join(base + ([node.module] if node.module else []))
                found.add("autoaccum" + ("." + module if module else ""))
            elif node.module and node.module.split(".")[0] == "autoaccum":
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
    modules = _modules()
    relative = {m.removeprefix("autoaccum").lstrip(".") for m in found}
    # "from autoaccum import checkpoint" names the package only to reach the submodule
    return {m for m in relative if m in modules and m not in (name, "")}


def _layer_of() -> dict[str, int]:
    return {m: i for i, layer in enumerate(LAYERS) for m in layer}


def test_every_module_has_a_place_in_the_flow():
    placed = _layer_of()
    missing = sorted(set(_modules()) - set(placed))
    assert not missing, f"place these modules in LAYERS: {missing}"
    stale = sorted(set(placed) - set(_modules()))
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_nothing_imports_upward_against_the_data_flow():
    layer = _layer_of()
    upward = [(m, dep) for m, path in _modules().items() for dep in _imports(path, m) if layer[dep] > layer[m]
              and not (m == "" or m == "__main__")]
    assert not upward, "imports against the data flow (module -> what it imports): " + ", ".join(
        f"{m or 'autoaccum'} -> {d}" for m, d in upward)


def test_the_module_import_graph_has_no_circle():
    modules = _modules()
    graph = {m: _imports(path, m) for m, path in modules.items()}
    graph[""] = set()  # the package __init__ re-exports everything: it is the top, not a node of circles
    for deps in graph.values():
        deps.discard("")
    visiting, done, cycle = set(), set(), []

    def visit(m: str, stack: list[str]) -> None:
        if m in done or cycle:
            return
        if m in visiting:
            cycle.extend(stack[stack.index(m):] + [m])
            return
        visiting.add(m)
        for dep in sorted(graph[m]):
            visit(dep, stack + [m])
        visiting.discard(m)
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    assert not cycle, " -> ".join(cycle)


@pytest.mark.parametrize("bad", [("memory_model", "probe"), ("plan", "guard")])
def test_negative_control_an_upward_import_is_seen(bad, tmp_path, monkeypatch):
    low, high = bad
    path = _modules()[low]
    fake = tmp_path / path.name
    fake.write_text(path.read_text() + f"\n\ndef _late():\n    from autoaccum.{high} import __name__ as n\n    return n\n")
    assert high in _imports(fake, low)
    assert _layer_of()[high] > _layer_of()[low]
