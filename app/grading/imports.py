"""The import graph of a repository's Python files, read with `ast` (no code is run).

`imports_of` resolves each import of a parsed module to a file of the repository, as Python
would from the test run's import roots (`sys.path` entries inside the repository); relative
imports are anchored at the module's own package.  `test_patch_additions` reads the lines a
`test_patch` adds, so the imports of new tests count too.
"""
from __future__ import annotations

import ast
import threading
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.grading.surface import Trees


# CPython 3.11 before 3.11.8 keeps the AST converter's recursion depth in interpreter-wide state, so
# two threads in `ast.parse` at once can fail with "SystemError: AST constructor recursion depth
# mismatch" (https://github.com/python/cpython/issues/106905).  Graders run in threads
# (`validate_instances(jobs=...)`), so every parse of the grading package goes through this lock.
_PARSE_LOCK = threading.Lock()


def parse(text: str | None) -> ast.Module | None:
    """`ast.parse(text)`, or None for no text or text that does not parse (SyntaxError, ValueError).

    Thread-safe: parses are serialised (see `_PARSE_LOCK`).
    """
    if text is None:
        return None
    try:
        with _PARSE_LOCK:
            return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None


def parsed_test_file(trees: Trees, test_patch_added: dict[str, str], path: str) -> list[ast.Module]:
    """The parsed versions of a test file: the base's, and the lines `test_patch` adds to it."""
    out = []
    for text in (trees.text(path, base=True), test_patch_added.get(path)):
        tree = parse(text)
        if tree is None and text:  # lines added to a file: read the import lines one by one
            lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("import ", "from "))]
            tree = parse("\n".join(ln for ln in lines if parse(ln) is not None))
        if tree is not None:
            out.append(tree)
    return out


def resolve(trees: Trees, dotted: str, roots: list[str]) -> str | None:
    parts = dotted.split(".")
    for root in roots:
        base = PurePosixPath(root) if root else PurePosixPath()
        for cand in (base.joinpath(*parts).with_suffix(".py") if parts else None,
                     base.joinpath(*parts, "__init__.py")):
            if cand is not None and trees.exists(str(cand)):
                return str(cand)
    return None


def imports_of(trees: Trees, module: ast.Module, path: str, roots: list[str]) -> list[tuple[str, list[str]]]:
    """(workspace file, names imported from it by name) for each import of `module` that resolves
    to a file of the repository."""
    out: list[tuple[str, list[str]]] = []
    own = [trees.basedir(path), *roots]
    pkg = PurePosixPath(path).parent.parts
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = resolve(trees, alias.name, own)
                if hit:
                    out.append((hit, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = pkg[: len(pkg) - (node.level - 1)] if node.level - 1 <= len(pkg) else ()
                dotted_parts = [*anchor, *(node.module.split(".") if node.module else [])]
                search = [""]
            else:
                dotted_parts = node.module.split(".") if node.module else []
                search = own
            dotted = ".".join(dotted_parts)
            hit = resolve(trees, dotted, search) if dotted else None
            if hit:
                out.append((hit, [a.name for a in node.names]))
            for alias in node.names:  # `from pkg import submodule`
                sub = resolve(trees, f"{dotted}.{alias.name}" if dotted else alias.name, search)
                if sub:
                    out.append((sub, []))
    return out


def definition(module: ast.Module | None, name: str) -> str | None:
    if module is None:
        return None
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return ast.dump(node)
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.dump(node)
    return None



def test_patch_additions(test_patch: str) -> dict[str, str]:
    """{path: the text of the lines `test_patch` adds to it} (for the imports of new tests)."""
    from app.grading.patching import PatchReadError, read_patch

    out: dict[str, str] = {}
    if not test_patch or not test_patch.strip():
        return out
    try:
        files = read_patch(test_patch).files
    except PatchReadError:
        return out
    for f in files:
        if f.new is None:
            continue
        added = [ln[1:] for ln in f.text.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        out[f.new] = "\n".join(added) + "\n"
    return out


