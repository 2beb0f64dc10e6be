"""The training system's layout (docs/operations.md, "Code layout"): its components import
only downward, in the order of ``rootopt.train``'s docstring, nothing in a training run
imports the commands in ``rootopt.train.tools``, and no function is over 60 lines.

Read from the sources with :mod:`ast`: an import inside a function counts (it runs when
called); one under ``if TYPE_CHECKING:`` does not (annotations only)."""

from __future__ import annotations

import ast
from pathlib import Path

import rootopt.train

TRAIN = Path(rootopt.train.__file__).parent

# Lowest first: each imports only itself and those before it.
LAYERS = (
    ("models",),
    ("metrics",),
    ("build", "schedule", "sync"),
    ("run",),
    ("checkpoint",),
    ("preflight",),
    ("data",),
    ("step",),
    ("policies",),
    ("loop",),
    ("main", "__main__"),
    ("tools",),
)
RANK = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _modules() -> dict[str, Path]:
    """``rootopt.train`` module name → file, less the package's own lazy ``__init__``."""
    out = {}
    for path in sorted(TRAIN.rglob("*.py")):
        rel = path.relative_to(TRAIN).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if parts:
            out[".".join(("rootopt.train", *parts))] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _runtime_imports(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The ``rootopt.train`` modules ``tree`` imports at run time."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import submodule` imports the submodule (the package is
            # already imported when the submodule is one of its own)
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in modules}


def _component(module: str) -> str:
    return module.split(".")[2]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _runtime_imports(ast.parse(path.read_text()), modules) - {name}
        for name, path in modules.items()
    }


def test_every_module_of_train_has_a_layer() -> None:
    assert {_component(m) for m in _modules()} == set(RANK)


def test_train_imports_point_downward() -> None:
    upward = [
        f"{name} imports {other}"
        for name, imports in _graph().items()
        for other in sorted(imports)
        if RANK[_component(other)] > RANK[_component(name)]
    ]
    assert upward == []


def test_train_has_no_import_cycles() -> None:
    graph = _graph()
    done: set[str] = set()

    def walk(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path, name))
        if name in done:
            return
        for other in sorted(graph[name]):
            walk(other, (*path, name))
        done.add(name)

    for name in sorted(graph):
        walk(name, ())


def test_a_training_run_never_imports_the_tools() -> None:
    users = sorted(
        name
        for name, imports in _graph().items()
        if _component(name) != "tools" and any(_component(m) == "tools" for m in imports)
    )
    assert users == []


def test_no_function_in_train_is_over_60_lines() -> None:
    """Decorators excluded: ``end_lineno - lineno + 1`` of the ``def``."""
    long = []
    for path in sorted(TRAIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(TRAIN)}:{node.lineno} {node.name} {lines}")
    assert long == []
