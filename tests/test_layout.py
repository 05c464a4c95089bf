"""The package's layout guards: imports point down the layers, modules import alone without cycles, the runtime's
files and functions stay short.

A reader should be able to open any file of ``scalebook.parallel`` or the runtime ``scalebook.train`` and read it
in one sitting (picotron's one file per dimension), and any function on one screen. These tests hold the line:
no allowlists; a file or function that grows past the limit is split, not excused.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "code" / "scalebook"
MAX_RUNTIME_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(_module_name(path) for path in PACKAGE.rglob("*.py"))


def _imports(path: Path, module: str, *, type_checking: bool = False) -> set[str]:
    """The scalebook modules that ``module`` imports, at module level or inside functions; those imported only for
    type checking (``if TYPE_CHECKING:``) too when ``type_checking``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found, pending = set(), [ast.parse(path.read_text(encoding="utf8"))]
    while pending:
        node = pending.pop()
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending += node.orelse
            continue
        pending += ast.iter_child_nodes(node)
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import name` imports the submodule pkg.name when there is one.
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return {name for name in found if name in MODULES and name != module}


#: The package's layers, lowest first. A module imports modules of its own layer and of the layers below, never
#: of one above: the model is written without knowing that it will be parallelised, parallelism without knowing
#: the loop that drives it (torchtitan's direction: ``models/`` -> ``distributed/`` -> ``trainer.py``). A layer
#: holds top-level modules and subpackages whole (``parallel`` is every ``scalebook.parallel.*``); each is in
#: exactly one layer, so a new module must be placed here before it can pass.
LAYERS = {
    "foundations": set(
        "configs compat citations accounting measure precision tokenizer data comm system calibration planner "
        "cluster_accounting plots parity scaling".split()
    ),
    "model": {"model", "moe", "llama", "mtp", "attention", "flash", "positions", "embeddings", "generate", "losses"},
    "parallel": {"parallel"},
    "runtime": {"train"},
    # the chapters' studies and tools; the root package, which imports any submodule lazily by name
    "applications": {"experiments", "labs", "hf_train", "cluster", "notebook", "widgets", "scalebook"},
}


def _unit(module: str) -> str:
    """The top-level module or subpackage of ``scalebook`` that ``module`` belongs to (``scalebook`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_imports_point_down_the_layers():
    """No module imports from a layer above its own (:data:`LAYERS`), counting imports inside functions and those
    made only for type checking: an import hidden in a function still makes the lower layer need the upper one."""
    rank = {unit: i for i, units in enumerate(LAYERS.values()) for unit in units}
    names = list(LAYERS)
    unplaced = sorted({_unit(m) for m in MODULES} - rank.keys())
    assert not unplaced, f"modules in no layer (add each to one of LAYERS in {Path(__file__).name}): {unplaced}"
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for imported in sorted(_imports(path, module, type_checking=True)):
            if rank[_unit(imported)] > rank[_unit(module)]:
                upward.append(f"{module} ({names[rank[_unit(module)]]}) imports {imported} "
                              f"({names[rank[_unit(imported)]]})")  # fmt: skip
    assert not upward, "imports up the layers (move the code down, or pass it in):\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    """The graph of imports between scalebook modules has no cycle.

    Imports inside functions count too: a lazy import is how a cycle (say the CLI importing the loop that imports
    the CLI) hides from the interpreter, not how it goes away.
    """
    graph = {_module_name(path): _imports(path, _module_name(path)) for path in PACKAGE.rglob("*.py")}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles (move the shared code to a module both can import):\n" + "\n".join(cycles)


def test_every_module_imports_alone():
    """Each module imports in an interpreter holding no other scalebook module, so none relies on import order.

    One subprocess (not one per module: ~45 fresh torch imports would take minutes on two cores) removes every
    ``scalebook`` entry of ``sys.modules`` before each import; third-party modules such as torch stay loaded,
    which cannot hide a cycle or a missing import inside the package.
    """
    script = textwrap.dedent(
        """
        import importlib, sys, traceback
        failures = []
        for name in sys.argv[1:]:
            for loaded in [m for m in sys.modules if m == "scalebook" or m.startswith("scalebook.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except (Exception, SystemExit):  # SystemExit: a script run on import
                failures.append(name + ":\\n" + traceback.format_exc(limit=-3))
        print("\\n".join(failures))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *MODULES], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", "modules that fail to import alone:\n" + result.stdout


def test_train_help_executes_every_module_once():
    """``python -m scalebook.train --help`` runs no module twice (runpy's "found in sys.modules" trap).

    An audit hook records every code object that ``exec`` runs at module level: a file of the package executed
    twice (once as ``__main__``, once under its import name) shows up twice.
    """
    script = textwrap.dedent(
        """
        import runpy, sys
        executed = []
        def hook(event, args):
            if event == "exec" and getattr(args[0], "co_name", "") == "<module>":
                executed.append(args[0].co_filename)
        sys.addaudithook(hook)
        sys.argv = ["scalebook.train", "--help"]
        try:
            runpy.run_module("scalebook.train", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
        else:
            code = 0
        mine = [f for f in executed if "/scalebook/" in f]
        print("\\n".join(sorted({f for f in mine if mine.count(f) > 1})), file=sys.stderr)
        sys.exit(code)
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert "RuntimeWarning" not in result.stderr, result.stderr
    assert result.stderr.strip() == "", "executed more than once:\n" + result.stderr


def test_parallel_and_runtime_files_stay_under_500_lines():
    """Every file of ``scalebook/parallel/`` and of the runtime (``scalebook/train``) reads in one sitting."""
    runtime = [*(PACKAGE / "parallel").rglob("*.py"), *(PACKAGE / "train").rglob("*.py")]
    lengths = {path.relative_to(REPO): len(path.read_text(encoding="utf8").splitlines()) for path in runtime}
    for package in ("parallel", "train"):
        assert (PACKAGE / package / "__init__.py").is_file(), f"scalebook.{package} is no longer a package"
    too_long = [f"{path}: {n} lines" for path, n in sorted(lengths.items()) if n > MAX_RUNTIME_FILE_LINES]
    assert not too_long, f"over {MAX_RUNTIME_FILE_LINES} lines (split by idea):\n" + "\n".join(too_long)


def _is_argument_declaration(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True when most of the function's lines are ``add_argument(...)`` calls (an argparse parser's declaration)."""
    lines = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            lines |= set(range(node.lineno, node.end_lineno + 1))
    return len(lines) * 2 >= function.end_lineno - function.lineno + 1


def test_no_function_over_80_lines():
    """No function or method in the package is longer than 80 lines (def to last line), argparse declarations aside."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not _is_argument_declaration(node):
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(too_long)
