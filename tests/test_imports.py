"""No two modules of ``hetjax/`` import each other (issue 29: one definition per idea).

The import graph is read from the source with ``ast``: every ``import`` and ``from ...
import`` anywhere in a module (inside functions and ``if TYPE_CHECKING:`` blocks too,
since a deferred import still ties the two modules together). ``from pkg import name``
counts as importing ``pkg.name`` when that is a module, else ``pkg`` (its ``__init__``).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "hetjax"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                base = ".".join([*base, node.module] if node.module else base)
            else:
                base = node.module or ""
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module c
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) for name, path in found.items()}


def mutual_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps if a < b and a in graph[b])


def test_the_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "hetjax.schedules.timed" in graph["hetjax.schedules.gantt"]  # relative
    assert "hetjax.schedules.gantt" in graph["hetjax.schedules.simulator"]  # in a method
    assert "hetjax.recompute" in graph["hetjax.config.tree"]


def test_no_two_modules_import_each_other():
    pairs = mutual_pairs(import_graph())
    assert not pairs, "modules that import each other: " + "; ".join(
        f"{a} <-> {b}" for a, b in pairs
    )
