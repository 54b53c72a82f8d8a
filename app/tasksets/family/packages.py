"""The generated packages of the `family` task set, and the instances (function x bug kind) planted in them.

`packages()` deals the functions of `POOL` to `PACKAGE_NAMES` with a fixed seed (four each), and
writes each package as files: `<name>/__init__.py`, `<name>/core.py` (the functions) and
`test_<name>.py` (one test per function, expected values computed from the clean function).
`instances()` plants every bug kind that has a spot in a function and changes what one of its
test calls returns; `Instance` carries the symptom a user would report (call, got, want).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from app.tasksets.family.mutate import KINDS, OUT_OF_FAMILY, mutate
from app.tasksets.family.pool import POOL, Func

PACKAGE_NAMES = ("abacus", "beacon", "cobalt", "dorado", "ember", "fathom", "garnet", "harbor", "indigo",
                 "juniper", "kestrel", "lumen", "meadow", "nimbus")
FUNCS_PER_PACKAGE = 5
DEAL_SEED = 20261202


@dataclass(frozen=True)
class Package:
    """A generated package: its name and functions, in module order."""

    name: str
    funcs: tuple[Func, ...]

    @property
    def module(self) -> str:
        return f"{self.name}/core.py"

    @property
    def test_file(self) -> str:
        return f"test_{self.name}.py"

    def files(self, replace: tuple[str, str] | None = None) -> dict[str, str]:
        """{relative path: text} of the package; `replace=(good line, bad line)` plants a bug in core.py."""
        names = ", ".join(f.name for f in self.funcs)
        core = f'"""Small helpers of {self.name}."""\n'
        for f in self.funcs:
            line = f.line
            if replace is not None and line == replace[0]:
                line = replace[1]
            core += f'\n\ndef {f.name}({f.params}):\n    """{f.doc}"""\n    {line}\n'
        tests = f"from {self.name} import {names}\n"
        for f in self.funcs:
            tests += f"\n\ndef test_{f.name}():\n"
            tests += "".join(f"    assert {f.name}({_args(c)}) == {evaluate(f.body, f.params, c)!r}\n"
                             for c in f.calls)
        return {f"{self.name}/__init__.py": f'"""Small helpers of {self.name}."""\nfrom {self.name}.core import {names}\n',
                self.module: core, self.test_file: tests}


@dataclass(frozen=True)
class Instance:
    """One bug: in `package`'s core.py, `func`'s line `good` becomes `bad`; `call` returns `got`, not `want`."""

    package: Package
    func: Func
    kind: str
    spot: int  # which spot of the kind in the line, 1 = leftmost
    good: str
    bad: str
    call: str
    got: str
    want: str

    @property
    def instance_id(self) -> str:
        suffix = "" if self.spot == 1 else f"{self.spot}"
        return f"family__{self.package.name}-{self.func.name}-{self.kind}{suffix}"

    @property
    def in_family(self) -> bool:
        return self.kind not in OUT_OF_FAMILY


def _args(call: tuple) -> str:
    return ", ".join(repr(a) for a in call)


def evaluate(body: str, params: str, call: tuple):
    """The value of `lambda params: body` at `call` (the pool's own code, never user input)."""
    return eval(f"lambda {params}: {body}", {})(*call)  # noqa: S307 - the expression is the package's own


def _outcome(body: str, params: str, call: tuple) -> str:
    """What a user sees at the prompt: the repr of the value, or the exception raised."""
    try:
        return repr(evaluate(body, params, call))
    except Exception as exc:  # noqa: BLE001 - a buggy line may raise anything; that is its symptom
        return f"{type(exc).__name__}: {exc}"


def _same(func: Func, bad_body: str, call: tuple) -> bool:
    """Whether the buggy body's value at `call` equals the clean one's (`==`, as the test asserts)."""
    try:
        return bool(evaluate(bad_body, func.params, call) == evaluate(func.body, func.params, call))
    except Exception:  # noqa: BLE001 - raising is a difference
        return False


@lru_cache(maxsize=1)
def packages() -> tuple[Package, ...]:
    """The packages, each with `FUNCS_PER_PACKAGE` functions of `POOL` dealt at random (seed `DEAL_SEED`).

    Raises ValueError when the pool is too small for the packages.
    """
    need = len(PACKAGE_NAMES) * FUNCS_PER_PACKAGE
    if len(POOL) < need:
        raise ValueError(f"the pool has {len(POOL)} functions; {len(PACKAGE_NAMES)} packages need {need}")
    funcs = list(POOL)
    random.Random(DEAL_SEED).shuffle(funcs)
    return tuple(Package(name, tuple(funcs[i * FUNCS_PER_PACKAGE:(i + 1) * FUNCS_PER_PACKAGE]))
                 for i, name in enumerate(PACKAGE_NAMES))


def plant(package: Package, func: Func, kind: str) -> list[Instance]:
    """The instances of bug `kind` in `func`, one per spot; a spot is left out when its buggy line
    is not valid Python or no test call then returns something else."""
    out = []
    for spot, bad_body in enumerate(mutate(kind, func.body), start=1):
        if bad_body == func.body:
            continue
        try:
            compile(f"lambda {func.params}: {bad_body}", "<bug>", "eval")
        except SyntaxError:
            continue
        for call in func.calls:
            want, got = _outcome(func.body, func.params, call), _outcome(bad_body, func.params, call)
            if _same(func, bad_body, call) or " at 0x" in got:
                continue  # the test's `==` would pass (250.0 == 250), or the symptom is not reproducible
            if got != want:
                out.append(Instance(package, func, kind, spot, func.line, f"return {bad_body}",
                                    f"{func.name}({_args(call)})", got, want))
                break
    return out


@lru_cache(maxsize=1)
def instances() -> tuple[Instance, ...]:
    """Every planted bug, package by package, function by function, in `KINDS` order."""
    out = []
    for package in packages():
        for func in package.funcs:
            for kind in KINDS:
                out += plant(package, func, kind)
    return tuple(out)
