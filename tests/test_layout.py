"""The code's layout, checked from its source: imports run jobs -> pipeline -> operators -> decoding and never back up
(at any level: a function's lazy import counts), no import circle among modules, the storage module imports nothing of
the config's, and the rooms stay small (functions, operators' modules, the actor)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("jobs", "pipeline", "operators", "decoding")  # each imports only from those after it (and itself)
FUNCTION_LINES = 40  # the longest function in jobs/, pipeline/ and operators/
OPERATOR_MODULE_LINES = 400
ACTOR_LINES = 200  # operators/recommender.py's Recommender


def modules(*packages: str) -> dict[str, Path]:
    """Module name -> file, for the packages' Python files."""
    out = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(path: Path, name: str) -> set[str]:
    """The modules a file imports, anywhere in it (module level, in functions, under TYPE_CHECKING), absolute."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}  # `from pipeline import storage`
    return out


def graph() -> dict[str, set[str]]:
    """Our modules -> the modules of ours each imports."""
    ours = modules(*LAYERS)
    return {name: {m for m in imported(path, name) if m in ours and m != name} for name, path in ours.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle among `edges`, as the modules along it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_imports_run_down_the_layers_only():
    up = [
        f"{name} imports {target}"
        for name, targets in graph().items()
        for target in targets
        if LAYERS.index(target.split(".")[0]) < LAYERS.index(name.split(".")[0])
    ]
    assert not up, up


def test_no_import_circle():
    assert cycle(graph()) is None, " -> ".join(cycle(graph()))


def test_storage_imports_nothing_of_the_config():
    assert not {m for m in graph()["pipeline.storage"] if m.startswith("pipeline.config")}


def test_the_rooms_stay_small():
    """No function over FUNCTION_LINES lines in jobs/, pipeline/ or operators/; no operators module over
    OPERATOR_MODULE_LINES; the actor class under ACTOR_LINES."""
    long = []
    for name, path in modules("jobs", "pipeline", "operators").items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if node.end_lineno - start + 1 > FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {node.end_lineno - start + 1} lines")
    assert not long, long
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules("operators").items()}
    big = {name: n for name, n in sizes.items() if n > OPERATOR_MODULE_LINES}
    assert not big, big
    tree = ast.parse((ROOT / "operators" / "recommender.py").read_text())
    (actor,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Recommender"]
    assert actor.end_lineno - actor.lineno + 1 <= ACTOR_LINES


@pytest.mark.parametrize(
    "edges, circle",
    [({"a": {"b"}, "b": {"c"}, "c": set()}, None), ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"])],
)
def test_the_circle_check_finds_one(edges, circle):
    assert cycle(edges) == circle


def test_the_import_reader_sees_lazy_relative_and_from_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from . import x\n\ndef g():\n    from pipeline import storage\n    import operators.spec\n")
    got = imported(f, "pipeline.m")
    assert {"pipeline.x", "pipeline.storage", "operators.spec"} <= got
