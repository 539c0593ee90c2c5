"""The import graph follows the data flow (README, Architecture): no circle, nothing imports upward.

Every module of the package sits in one layer (a sub-package is one layer); a module may import its own layer and the
layers before it, never a later one -- imports inside functions included (a lazy import is a dependency too). A new
module must be placed here, which is the point: its place in the flow is decided.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoaccum"

LAYERS: list[tuple[str, ...]] = [
    # plain values and rules used everywhere
    ("errors", "units", "validate", "jsonio", "log", "state", "precision", "modules"),
    # memory: meters, the emulated budget, capacity, OOM detection and recovery, the memory model, the savers
    ("memory",),
    # what a step is: batches, tasks, the plan, cuts, global batches
    ("plan",),
    # how ranks agree, torch.distributed: the sync the step runs in, DDP, FSDP2
    ("distributed",),
    # one exact step: accumulate, the optimizer step, the losses
    ("step",),
    # measure (real steps) -> model -> plan
    ("probe",),
    # the OOM guard on top of the step: replay, the policy, growth
    ("guard",),
    # fit and its parts
    ("training",),
    # inside other trainers: HF Trainer, Lightning, Accelerate (each imports its framework itself)
    ("integrations",),
    # the optional throughput search
    ("search",),
    # the entry points, and the demo task the command line runs without a task of the user's
    ("cli", "demo", "__main__", ""),
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
                # "from autoaccum.probe import cache" reaches the submodule: the package itself only
                # where a name imported is not a submodule of it
                inner = {f"{node.module}.{a.name}" for a in node.names}
                submodules = {m for m in inner if m.removeprefix("autoaccum.") in _modules()}
                found |= submodules | ({node.module} if inner - submodules else set())
    modules = _modules()
    relative = {m.removeprefix("autoaccum").lstrip(".") for m in found}
    # "from autoaccum import checkpoint" names the package only to reach the submodule
    return {m for m in relative if m in modules and m not in (name, "")}


def _layer_of() -> dict[str, int]:
    """Each module's layer: a top-level module's own, or its sub-package's (every module in it)."""
    top = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    return {m: top[m.split(".")[0]] for m in _modules() if m.split(".")[0] in top}


def test_every_module_has_a_place_in_the_flow():
    placed = _layer_of()
    missing = sorted(set(_modules()) - set(placed))
    assert not missing, f"place these modules (or their sub-package) in LAYERS: {missing}"
    stale = sorted({m for layer in LAYERS for m in layer} - {m.split(".")[0] for m in _modules()})
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


@pytest.mark.parametrize("bad", [("memory.model", "probe.run"), ("plan.plan", "guard.guard"),
                                 ("distributed.sync", "step.accumulate")])
def test_negative_control_an_upward_import_is_seen(bad, tmp_path, monkeypatch):
    low, high = bad
    path = _modules()[low]
    fake = tmp_path / path.name
    fake.write_text(path.read_text()
                    + f"\n\ndef _late():\n    from autoaccum.{high} import __name__ as n\n    return n\n")
    assert high in _imports(fake, low)
    assert _layer_of()[high] > _layer_of()[low]
