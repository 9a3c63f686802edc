"""The shape of the code: layers point one way, modules and functions stay small.

Reads the sources with ``ast`` (nothing is imported): every import in ``diffcost/`` and
``calibration/``, at module level or inside a function, is an edge of the import graph.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("diffcost", "calibration")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80  # body lines, docstring excluded


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _owner(name: str) -> str | None:
    """The project module ``name`` refers to (a module, or a name inside one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str):
    """(imported project module, imported names) of every import statement in ``module``."""
    is_package = MODULES[module].name == "__init__.py"
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := _owner(alias.name)) is not None:
                    yield target, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parent + ([node.module] if node.module else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            names = [a.name for a in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            if len(submodules) == len(names):  # from package import module, ...
                yield from ((m, []) for m in submodules)
            elif (target := _owner(base)) is not None:
                yield target, [n for n in names if f"{base}.{n}" not in MODULES]


GRAPH = {m: {t for t, _ in _imports(m) if t != m} for m in MODULES}


def test_the_core_never_imports_calibration():
    upward = sorted(
        (m, t)
        for m, ts in GRAPH.items()
        for t in ts
        if m.startswith("diffcost") and t.startswith("calibration")
    )
    assert upward == []


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(m, path):
        state[m] = 1
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_private_name_imported_across_modules():
    private = sorted(
        (m, t, n)
        for m in MODULES
        for t, names in _imports(m)
        for n in names
        if n.startswith("_") and t != m
    )
    assert private == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_functions_stay_small(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module}: {lines} lines"
    long = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            docstring = (
                isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            )
            start = body[1].lineno if docstring and len(body) > 1 else body[0].lineno
            if (n := node.end_lineno - start + 1) > MAX_FUNCTION_LINES:
                long.append(f"{node.name}: {n} lines")
    assert long == [], module


# the test files and the benchmark scripts (not packages: only their length is checked)
SCRIPTS = [p for folder in ("tests", "benchmarks") for p in sorted((ROOT / folder).glob("*.py"))]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_test_and_benchmark_files_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.parent.name}/{path.name}: {lines} lines"
