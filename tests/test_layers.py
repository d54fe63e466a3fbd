"""The package's layers: each package imports only from the layers below it, no module imports
itself through others, and no module name is used twice (docs/architecture.md maps them)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"

# Bottom up; names on one floor may not import each other across packages either.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("clock", "redact", "histogram", "log_setup", "log_throttle", "build", "exceptions"),
    ("policy",),
    ("algorithms",),
    ("limits",),
    ("stores",),
    ("engine",),
    ("edge",),
    ("observability",),
    ("admin", "replay"),
    ("policytest", "suggest"),
    ("serving",),
    ("cli",),
    ("__main__",),
)
FLOOR = {name: floor for floor, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(GATEWAY.rglob("*.py")):
        parts = path.relative_to(GATEWAY.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(path: Path, known: set[str]) -> set[str]:
    """The gateway modules ``path`` imports, ``TYPE_CHECKING`` imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("gateway"):
                continue
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gateway"))
    return {name for name in found if name in known}


def _floor_name(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_floor() -> None:
    names = {_floor_name(m) for m in _modules()} - {None}
    assert names <= set(FLOOR), f"add to LAYERS: {sorted(names - set(FLOOR))}"


def test_no_import_runs_up_the_layers() -> None:
    modules = _modules()
    up = []
    for module, path in modules.items():
        source = _floor_name(module)
        for target in _imports(path, set(modules)):
            into = _floor_name(target)
            if source is None or into is None or into == source:
                continue
            if FLOOR[into] >= FLOOR[source]:
                up.append(f"{module} -> {target}")
    assert up == []


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {m: _imports(p, set(modules)) - {m} for m, p in modules.items()}
    # A package's __init__ is imported with each of its modules: not an edge of its own.
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_module_name_is_used_twice() -> None:
    names = Counter(
        path.stem for path in GATEWAY.rglob("*.py") if path.stem not in ("__init__", "__main__")
    )
    assert [name for name, count in names.items() if count > 1] == []
