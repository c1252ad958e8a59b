"""The package's layers (docs/architecture.md): a module imports only from its own layer or
lower ones — at module level, inside functions and under TYPE_CHECKING alike — and the
imports within a layer form no cycle. Parses the sources; needs no engine."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "deltamq"

# lowest first; a module belongs to the first layer one of whose patterns matches it
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        (
            "deltamq.constants",
            "deltamq.errors",
            "deltamq.clock",
            "deltamq.pipes",
            "deltamq.ids",
            "deltamq.faults",
            "deltamq.arrow_memory",
            "deltamq._sail_child",
            "deltamq.config",
            "deltamq.schemas",
            "deltamq.message",
            "deltamq.consumer",
            "deltamq.filters",
            "deltamq.sending",
            "deltamq.sending_arrow",
            "deltamq.rebalance",
            "deltamq.pull_log",
            "deltamq.demo_listeners",
        ),
    ),
    (
        "engine",
        (
            "deltamq.spark_setup",
            "deltamq.spark_connect",
            "deltamq.sail",
            "deltamq.storage",
            "deltamq.store_faults",
            "deltamq.delta_append",
            "deltamq.delta_read",
            "deltamq.body_reads",
            "deltamq.file_reads",
            "deltamq.engine",
        ),
    ),
    (
        "tables",
        (
            "deltamq.tables",
            "deltamq.tables.*",
            "deltamq.dedup",
            "deltamq.transactions",
            "deltamq.tables.leases",
        ),
    ),
    ("catalog", ("deltamq.catalog", "deltamq.context")),
    (
        "services",
        (
            "deltamq.jobs",
            "deltamq.jobs.*",
            "deltamq.pull",
            "deltamq.pull_reads",
            "deltamq.pull_engine",
            "deltamq.pull_files",
            "deltamq.dq",
            "deltamq.dq.*",
            "deltamq.ops",
            "deltamq.inspection",
            "deltamq.producer",
            "deltamq.report",
            "deltamq.report_data",
            "deltamq.lite",
        ),
    ),
    ("runner", ("deltamq.orchestration", "deltamq.orchestration.tick", "deltamq.orchestration.results")),
    ("facade", ("deltamq", "deltamq.broker")),
    (
        "entry points",
        ("deltamq.cli", "deltamq.cli.*", "deltamq.orchestration.runs", "deltamq.orchestration.submit"),
    ),
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to (``deltamq.jobs.dispatch.load`` → ``deltamq.jobs.dispatch``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    """Every deltamq module ``module`` imports, anywhere in its source."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            if name.startswith("deltamq"):
                target = _resolve(name)
                if target is not None and target != module:
                    found.add(target)
    # `from deltamq.x import y` also resolves the bare package `deltamq`: not a dependency
    found.discard("deltamq")
    return found


def layer_of(module: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    raise AssertionError(
        f"{module} is in no layer: add it to LAYERS (tests/test_layers.py) and docs/architecture.md"
    )


@pytest.mark.unit
def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.unit
@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_its_own_layer_or_lower(module):
    mine = layer_of(module)
    upward = sorted(t for t in _imports(module) if layer_of(t) > mine)
    assert not upward, f"{module} ({LAYERS[mine][0]}) imports a higher layer: " + ", ".join(
        f"{t} ({LAYERS[layer_of(t)][0]})" for t in upward
    )


@pytest.mark.unit
def test_no_import_cycles():
    graph = {m: _imports(m) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.unit
def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The layering check is not vacuous: an import inside a function body is found."""
    assert "deltamq.broker" in _imports("deltamq.cli.demo") or "deltamq.broker" in _imports("deltamq.cli")
    assert "deltamq.jobs.dispatch" in _imports("deltamq.ops")  # imported inside ops.rebuild_index


# Each hot control table has one owner module in deltamq/tables/ that writes every SQL
# statement over it; others use its typed functions (or read it as a DataFrame).
# deltamq/dq/ is the exception on purpose: its checks are an independent SQL audit of
# the tables, and auditing through the code being audited would prove less. So are the
# views for SQL users (deltamq/tables/views.py): SQL text users query, over any catalog.
SQL_OWNERS = {
    "offsets": "deltamq/tables/offsets.py",
    "consume_queue": "deltamq/tables/consume_queue.py",
    "commit_log": "deltamq/tables/commit_log.py",
}


@pytest.mark.unit
@pytest.mark.parametrize("table", sorted(SQL_OWNERS))
def test_only_the_owner_writes_sql_against_a_hot_table(table):
    import re

    reference = re.compile(r"""\.ref\(\s*['"]""" + table + r"""['"]\s*\)""")
    root = PACKAGE.parent
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(root)) != SQL_OWNERS[table]
        and "deltamq/dq/" not in str(path.relative_to(root))
        and str(path.relative_to(root)) != "deltamq/tables/views.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reference.search(line)
    ]
    assert not offenders, f"SQL over {table} outside {SQL_OWNERS[table]}: {offenders}"
    assert reference.search(Path(root / SQL_OWNERS[table]).read_text()), "the check would find a reference"


MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80  # the def's whole span, docstring included


@pytest.mark.unit
def test_modules_and_functions_stay_a_size_a_newcomer_can_read():
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(PACKAGE.parent))
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({span} lines)")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
