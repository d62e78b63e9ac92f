"""The house's rules that code can check (CONTRIBUTING.md, Layout): the package's import graph, imports
inside functions included, has no cycle, and its arrows point down the floors -- ``cli`` above
``pipelines`` above ``train`` (and ``run_values``) above ``bnn``, ``data`` and ``report``, above ``moments`` and ``runtime``;
``runtime`` imports only itself and ``moments`` only itself and ``runtime``; no pipeline imports another."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cfbnn_cli"
FLOORS = {
    "moments": 0,
    "runtime": 0,
    "bnn": 1,
    "data": 1,
    "report": 1,
    "train": 2,
    "run_values": 2,  # the config's values as objects (device, estimator, likelihood), for the pipelines
    "pipelines": 3,
    "cli": 4,
    "cli_messages": 4,  # the CLI's one-line refusals
    "completion": 4,  # the CLI's shell-completion script
}


def _modules():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph():
    """``{module: {modules it imports}}`` (``from . import x`` counts as importing the submodule ``x``;
    the root package, which holds only the version, is left out)."""
    modules = _modules()
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
                targets = submodules or [target]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            edges[name].update(t for t in targets if t in modules and t not in (name, "cfbnn_cli"))
    return edges


def _floor(module: str) -> str:
    return module.split(".")[1]


def test_the_import_graph_has_no_cycle():
    edges = import_graph()
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_arrows_point_down_the_floors():
    upward = []
    for module, targets in import_graph().items():
        if module == "cfbnn_cli":
            continue
        for target in targets:
            source_floor, target_floor = _floor(module), _floor(target)
            if FLOORS[target_floor] > FLOORS[source_floor]:
                upward.append(f"{module} -> {target}")
            if source_floor == "runtime" and target_floor != "runtime":
                upward.append(f"{module} -> {target} (runtime imports only runtime)")
            if source_floor == "moments" and target_floor not in ("moments", "runtime"):
                upward.append(f"{module} -> {target} (moments imports only moments and runtime)")
            if source_floor == target_floor == "pipelines" and module.split(".")[2] != target.split(".")[2]:
                upward.append(f"{module} -> {target} (a pipeline imports no other pipeline)")
    assert not upward, upward


def test_the_graph_sees_imports_inside_functions():
    """The checker itself: ``runtime.environment`` imports torch inside a function, and
    ``cli`` imports pipelines only inside functions."""
    edges = import_graph()
    assert "cfbnn_cli.report.aggregate" in edges["cfbnn_cli.cli"]
    assert "cfbnn_cli.moments.relu_family" in edges["cfbnn_cli.moments.activations"]  # (a relative import)
