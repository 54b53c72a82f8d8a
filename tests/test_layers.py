"""The one-way layering of `app`: import-linter contracts (`.importlinter`), no import loops
between app's packages nor between modules, and run validation without torch in the API process."""
from __future__ import annotations

import graphlib
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from app.config import ROOT

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                              "sys.argv = ['lint-imports', '--no-cache']; lint_imports_command()"]


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_import_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_a_control_module_that_imports_celery_breaks_the_contracts(tmp_path):
    """The contracts can fail: the same check on a copy where the control loop imports the task layer."""
    shutil.copytree(ROOT / "app", tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    scheduler = tmp_path / "app" / "control" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\nfrom app.tasks.send import send  # noqa: E402\n")
    result = _lint(tmp_path)
    assert result.returncode == 1
    assert "app.control is not allowed to import app.tasks" in result.stdout
    assert "Only the task layer knows Celery BROKEN" in result.stdout


def test_a_cli_command_that_imports_another_breaks_the_contracts(tmp_path):
    """Command modules share app.cli.client and app.cli.report only: `learn` importing `runs` is refused."""
    shutil.copytree(ROOT / "app", tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    learning = tmp_path / "app" / "cli" / "learning.py"
    learning.write_text(learning.read_text() + "\nfrom app.cli.runs import cmd_export  # noqa: E402\n")
    result = _lint(tmp_path)
    assert result.returncode == 1
    assert "CLI command modules do not import one another" in result.stdout and "BROKEN" in result.stdout
    assert "app.cli.learning is not allowed to import app.cli.runs" in result.stdout


def test_no_import_loop_between_packages():
    """Squashed to app's packages (app.control, app.proxy, ...), the import graph has no cycle."""
    graph = grimp.build_graph("app")
    packages = sorted({".".join(m.split(".")[:2]) for m in graph.modules if m.count(".") >= 1})
    edges: dict[str, set[str]] = {p: set() for p in packages}
    for module in graph.modules:
        src = ".".join(module.split(".")[:2])
        if src == "app":
            continue  # the package root only holds create_app(), the gunicorn/test entry point
        for imported in graph.find_modules_directly_imported_by(module):
            dst = ".".join(imported.split(".")[:2])
            if imported.startswith("app.") and dst != src:
                edges[src].add(dst)
    # Depth-first search for a back edge.
    colour: dict[str, int] = {}
    loops: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        colour[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if colour.get(nxt) == 1:
                loops.append(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt])
            elif not colour.get(nxt):
                visit(nxt, path + [node])
        colour[node] = 2

    for p in packages:
        if not colour.get(p):
            visit(p, [])
    assert loops == [], loops


def import_circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Circles of direct imports among the graph's modules, each as [a, b, ..., a] where a imports b.

    Every import counts, module-level, in a function or under `TYPE_CHECKING`.  Found one at a time by
    the standard library's topological sort (`graphlib.CycleError` names one circle); the circle's
    first import is then dropped and the sort run again, so every circle of the graph yields at least
    one entry (and two circles sharing that import yield one)."""
    imports = {m: set(graph.find_modules_directly_imported_by(m)) & graph.modules for m in graph.modules}
    circles: list[list[str]] = []
    while True:
        try:
            graphlib.TopologicalSorter(imports).prepare()  # imported modules are each module's predecessors
        except graphlib.CycleError as exc:
            circle = list(reversed(exc.args[1]))  # graphlib lists each node before the one that imports it
            circles.append(circle)
            imports[circle[0]].discard(circle[1])
        else:
            return circles


def test_no_import_circle_between_modules():
    """No module of app reaches itself through its imports, within a package or across packages."""
    circles = import_circles(grimp.build_graph("app"))
    assert circles == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_import_circles_are_found():
    """The check can fail: a three-module circle inside one package, next to a one-way import, is reported."""
    graph = grimp.ImportGraph()
    for importer, imported in [("p.grader", "p.image"), ("p.image", "p.harbor"), ("p.harbor", "p.grader"),
                               ("p.harbor", "p.steps")]:
        graph.add_import(importer=importer, imported=imported)
    (circle,) = import_circles(graph)
    assert len(circle) == 4 and circle[0] == circle[-1]
    assert set(circle) == {"p.grader", "p.image", "p.harbor"}
    assert all((a, b) in {("p.grader", "p.image"), ("p.image", "p.harbor"), ("p.harbor", "p.grader")}
               for a, b in zip(circle, circle[1:]))


def test_a_circle_inside_a_package_breaks_the_contracts(tmp_path):
    """The acyclic-siblings contract fails on a circle between two modules of one package: the
    gateway's settings importing the normalization module that imports them."""
    shutil.copytree(ROOT / "app", tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    settings = tmp_path / "app" / "proxy" / "settings.py"
    settings.write_text(settings.read_text() + "\nfrom app.proxy import common  # noqa: E402,F401\n")
    result = _lint(tmp_path)
    assert result.returncode == 1
    assert "No import circle among the siblings of any package" in result.stdout and "BROKEN" in result.stdout
    assert "No cycles are allowed in app.proxy" in result.stdout


def test_run_validation_in_the_api_process_imports_no_torch():
    code = (
        "import sys\n"
        "from app.runconfig import RunConfig\n"
        "from app.control.runs import check_run_config\n"
        "import app.api.runs, app.tasks.control\n"
        "cfg = RunConfig.model_validate({'kind': 'train', 'training': {'learning_rate': 1e-5, 'lora': True}})\n"
        "check_run_config(cfg)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
