"""Framework reach: what a kept Python file newly does that reaches into the test framework or the interpreter.

Pytest runs the tests in the process the code under
test runs in, so whatever that code does to pytest's objects is what the report shows.  A
Python file the patch keeps is read with `ast`, and what it newly does (compared with the
base version) that reaches into the test framework or the interpreter is listed: importing
`_pytest`, `pytest` or `pluggy`; `unittest` beyond `unittest.mock`; defining pytest hooks
(`pytest_*`) or `pytest_plugins`; writing `sys.modules`, `sys.meta_path`, `sys.path_hooks` or
builtins; reading interpreter frames or the garbage collector's object lists; tracing
hooks; `os._exit` and `atexit`; code or module names built at run time (`exec`, `eval`,
`__import__` of a non-constant).  Any such finding grades the patch unresolved, with the
finding recorded (`report["tampering"]`).  A framework the repository itself provides
(pytest's own repository) is not counted.
"""
from __future__ import annotations

import ast
import re
from typing import Iterable

from app.grading.imports import parse

FRAMEWORKS = ("_pytest", "pytest", "pluggy")
_BUILTINS = frozenset({"builtins", "__builtins__", "__builtin__"})
_SYS_IMPORT_STATE = frozenset({"sys.modules", "sys.meta_path", "sys.path_hooks", "sys.path_importer_cache"})
_MUTATORS = frozenset({"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__", "insert",
                       "append", "extend", "remove"})
_INTERNALS = {
    "sys._getframe": "reads interpreter frames", "sys._current_frames": "reads interpreter frames",
    "inspect.currentframe": "reads interpreter frames", "inspect.stack": "reads interpreter frames",
    "inspect.getouterframes": "reads interpreter frames", "inspect.trace": "reads interpreter frames",
    "sys.settrace": "installs a tracing hook", "sys.setprofile": "installs a tracing hook",
    "threading.settrace": "installs a tracing hook", "threading.setprofile": "installs a tracing hook",
    "sys.monitoring": "installs a tracing hook", "sys.addaudithook": "installs an audit hook",
    "gc.get_objects": "walks the garbage collector's objects", "gc.get_referrers": "walks the garbage collector's objects",
    "gc.get_referents": "walks the garbage collector's objects",
    "os._exit": "exits the interpreter past the test runner", "atexit.register": "runs code after the test runner",
    "sys.__stdout__": "writes past the test runner's output capture",
    "sys.__stderr__": "writes past the test runner's output capture",
}
_FRAME_ATTRS = frozenset({"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame", "cr_frame", "ag_frame"})
_HOOK_STRING = re.compile(r"^(_pytest(\.\w+)*|pytest\.\w+(\.\w+)*|pluggy(\.\w+)*|pytest_\w+|unittest\.(?!mock\b)\w+(\.\w+)*)$")


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


class _Reach(ast.NodeVisitor):
    def __init__(self, own: set[str], depth: int = 0):
        self.own, self.depth = own, depth
        self.aliases: dict[str, str] = {}
        self.found: set[str] = set()

    def module(self, name: str, names: Iterable[str] = ()) -> None:
        top, _, rest = name.partition(".")
        if top in self.own:
            return
        if top in FRAMEWORKS:
            self.found.add(f"imports the test framework ({name})")
        elif top == "unittest":
            sub = rest.split(".")[0] if rest else None
            if sub and sub != "mock" or (not sub and any(n != "mock" for n in names)) or (not sub and not names):
                self.found.add(f"imports unittest internals ({name}{' ' + ', '.join(names) if names else ''})")
        elif top == "ctypes":
            self.found.add("imports ctypes (raw memory access)")
        elif top == "sys":
            for n in names:
                key = f"sys.{n}"
                if key in _SYS_IMPORT_STATE:
                    self.found.add(f"imports {key}")
                elif key in _INTERNALS:
                    self.found.add(f"{_INTERNALS[key]} ({key})")
        elif top in ("inspect", "gc", "os", "atexit", "threading"):
            for n in names:
                key = f"{top}.{n}"
                if key in _INTERNALS:
                    self.found.add(f"{_INTERNALS[key]} ({key})")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.module(a.name)
            if a.asname:
                self.aliases[a.asname] = a.name
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.level and node.module:
            self.module(node.module, [a.name for a in node.names])
            for a in node.names:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        self.generic_visit(node)

    def _def(self, node) -> None:
        if node.name.startswith("pytest_") and not self.own & set(FRAMEWORKS):  # pytest's own repository
            self.found.add(f"defines a pytest hook ({node.name})")
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _def

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "pytest_plugins" and isinstance(node.ctx, ast.Store):
            self.found.add("sets pytest_plugins")
        dotted = self.aliases.get(node.id)
        if dotted:
            self._dotted_use(dotted, node.ctx)

    def _dotted_use(self, dotted: str, ctx: ast.expr_context) -> None:
        top = dotted.split(".")[0]
        if top in self.own:
            return
        if top in _BUILTINS and isinstance(ctx, (ast.Store, ast.Del)) and "." in dotted:
            self.found.add(f"assigns builtins ({dotted})")
        if top == "unittest" and len(dotted.split(".")) > 1 and dotted.split(".")[1] != "mock":
            self.found.add(f"reaches into unittest ({'.'.join(dotted.split('.')[:3])})")
        if top in FRAMEWORKS:
            self.found.add(f"reaches into the test framework ({'.'.join(dotted.split('.')[:3])})")
        for key, what in _INTERNALS.items():
            if dotted == key or dotted.startswith(key + "."):
                self.found.add(f"{what} ({key})")
        if isinstance(ctx, (ast.Store, ast.Del)) and any(dotted == k or dotted.startswith(k + ".") for k in _SYS_IMPORT_STATE):
            self.found.add(f"writes {'.'.join(dotted.split('.')[:2])}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in _FRAME_ATTRS:
            self.found.add(f"reads interpreter frames (.{node.attr})")
        dotted = _dotted(node, self.aliases)
        if dotted:
            self._dotted_use(dotted, node.ctx)
            if isinstance(node.ctx, ast.Load):
                return  # its prefix is a part of this chain, judged once
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        target = _dotted(node.value, self.aliases)
        if isinstance(node.ctx, (ast.Store, ast.Del)) and target:
            if target in _SYS_IMPORT_STATE:
                self.found.add(f"writes {target}")
            if target.split(".")[0] in _BUILTINS:
                self.found.add(f"assigns builtins ({target}[...])")
        if isinstance(node.ctx, ast.Load) and target == "sys.modules" and not (
                isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            self.found.add("reads sys.modules with a key built at run time")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and isinstance(node.value, ast.Call):
            inner = _dotted(node.value.func, self.aliases)
            if inner == "vars" and node.value.args and (_dotted(node.value.args[0], self.aliases) or "").split(".")[0] in _BUILTINS:
                self.found.add("assigns builtins (vars(builtins)[...])")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = _dotted(node.func, self.aliases) or ""
        first = node.args[0] if node.args else None
        const = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
        if func in ("setattr", "delattr") and first is not None:
            target = _dotted(first, self.aliases) or ""
            if target.split(".")[0] in _BUILTINS:
                self.found.add(f"assigns builtins ({func}({target}, ...))")
            if target in _SYS_IMPORT_STATE or target == "sys":
                self.found.add(f"writes {target} ({func})")
            if target.split(".")[0] in FRAMEWORKS + ("unittest",) and target.split(".")[0] not in self.own:
                self.found.add(f"patches the test framework ({func}({target}, ...))")
        head, _, method = func.rpartition(".")
        if method in _MUTATORS and (head in _SYS_IMPORT_STATE or head.split(".")[0] in _BUILTINS):
            self.found.add(f"writes {head} (.{method})")
        if func in ("sys.modules.values", "sys.modules.items", "sys.modules.copy", "sys.modules.keys"):
            self.found.add(f"walks sys.modules ({func})")
        if func == "sys.modules.get" and const is None:
            self.found.add("reads sys.modules with a key built at run time")
        if func == "sys.modules.get" and const is not None:
            self.module(const)
        if func in ("__import__", "importlib.import_module", "importlib.__import__", "builtins.__import__"):
            if const is not None:
                self.module(const)
            else:
                self.found.add(f"imports a module named at run time ({func})")
        if func in ("exec", "eval", "compile", "builtins.exec", "builtins.eval"):
            if const is not None and self.depth < 3:
                inner = parse(const)
                if inner is not None:
                    sub = _Reach(self.own, self.depth + 1)
                    sub.aliases = dict(self.aliases)
                    sub.visit(inner)
                    self.found |= sub.found
            elif const is None:
                self.found.add(f"runs code built at run time ({func})")
        if func == "vars" and first is not None and (_dotted(first, self.aliases) or "").split(".")[0] in _BUILTINS:
            self.found.add("reaches builtins' namespace (vars(builtins))")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in _FRAME_ATTRS:
            self.found.add(f"reads interpreter frames ({node.value!r})")
        if isinstance(node.value, str) and len(node.value) < 200 and _HOOK_STRING.match(node.value):
            top = node.value.split(".")[0]
            if top not in self.own:
                self.found.add(f"names the test framework in a string ({node.value!r})")


def reach_findings(text: str | None, own: set[str]) -> set[str] | None:
    """What `text` (Python source) does that reaches into the test framework or the interpreter
    (module docstring); None when it does not parse."""
    module = parse(text)
    if module is None:
        return None
    visitor = _Reach(own)
    visitor.visit(module)
    return visitor.found


def framework_reach(base_text: str | None, new_text: str | None, own: set[str] = frozenset()) -> list[str]:
    """The findings of `new_text` that `base_text` (None: a new file) does not have, sorted.

    `own`: top-level names the repository provides itself (its own `_pytest`, say), never counted.
    A new text that does not parse has no findings (Python cannot import it either).
    """
    after = reach_findings(new_text, set(own))
    if not after:
        return []
    before = reach_findings(base_text, set(own)) or set()
    return sorted(after - before)
