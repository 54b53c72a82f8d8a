"""The starter family's table of bugs and the packages they are planted in.

The packages are real files under `packages/<name>/` (the package folder and its one pytest
file), read by `package_files`; a `Bug` names one line of one package's module and the wrong
line that replaces it, with the symptom a user would report.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PACKAGES_DIR = Path(__file__).resolve().parent / "packages"

# The module of each package that holds its functions (and so every bug).
MODULES = {"mathkit": "mathkit/ops.py", "textkit": "textkit/strings.py", "listkit": "listkit/items.py",
           "tempkit": "tempkit/convert.py", "checkkit": "checkkit/checks.py"}


@dataclass(frozen=True)
class Bug:
    """One instance: in `package`'s module, line `good` becomes `bad`; `call`/`got`/`want` describe the symptom."""

    package: str
    number: int
    func: str
    good: str
    bad: str
    call: str
    got: str
    want: str
    hint: str  # "fix": the user names the suspicious line and what it should be; "line": only the line
    split: str  # "train" | "heldout"

    @property
    def instance_id(self) -> str:
        return f"starter__{self.package}-{self.number}"


BUGS: tuple[Bug, ...] = (
    Bug("mathkit", 1, "add", "return a + b", "return a + b + 1", "add(2, 3)", "6", "5", "fix", "train"),
    Bug("mathkit", 2, "multiply", "return a * b", "return a ** b", "multiply(4, 3)", "64", "12", "line", "train"),
    Bug("mathkit", 3, "is_even", "return n % 2 == 0", "return n % 2 == 1", "is_even(4)", "False", "True", "fix", "train"),
    Bug("mathkit", 4, "square", "return x ** 2", "return x * 2", "square(3)", "6", "9", "line", "heldout"),
    Bug("textkit", 1, "shout", "return text.upper() + \"!\"", "return text.lower() + \"!\"", "shout(\"hi\")", "'hi!'",
        "'HI!'", "fix", "train"),
    Bug("textkit", 2, "greet", "return \"Hello, \" + name", "return \"Goodbye, \" + name", "greet(\"Ada\")",
        "'Goodbye, Ada'", "'Hello, Ada'", "line", "train"),
    Bug("textkit", 3, "reverse", "return text[::-1]", "return text[::1]", "reverse(\"abc\")", "'abc'", "'cba'", "fix",
        "train"),
    Bug("textkit", 4, "count_words", "return len(text.split())", "return len(text)", "count_words(\"one two three\")",
        "13", "3", "fix", "heldout"),
    Bug("listkit", 1, "last", "return items[-1]", "return items[1]", "last([7, 8, 9])", "8", "9", "fix", "train"),
    Bug("listkit", 2, "total", "return sum(items)", "return len(items)", "total([1, 2, 3])", "3", "6", "line", "train"),
    Bug("listkit", 3, "largest", "return max(items)", "return max(items) - 1", "largest([3, 9, 4])", "8", "9", "fix",
        "train"),
    Bug("listkit", 4, "first", "return items[0]", "return items[2]", "first([7, 8, 9])", "9", "7", "line", "heldout"),
    Bug("tempkit", 1, "celsius_to_kelvin", "return c + 273.15", "return c - 273.15", "celsius_to_kelvin(0)", "-273.15",
        "273.15", "fix", "heldout"),
    Bug("tempkit", 2, "is_freezing", "return c <= 0", "return c < 0", "is_freezing(0)", "False", "True", "line",
        "heldout"),
    Bug("tempkit", 3, "celsius_to_fahrenheit", "return c * 9 / 5 + 32", "return c * 9 / 5 - 32",
        "celsius_to_fahrenheit(100)", "148.0", "212.0", "fix", "heldout"),
    Bug("checkkit", 1, "is_positive", "return n > 0", "return n >= 0", "is_positive(0)", "True", "False", "fix",
        "heldout"),
    Bug("checkkit", 2, "both", "return bool(a and b)", "return bool(a) or bool(b)", "both(True, False)", "True", "False",
        "line", "heldout"),
    Bug("checkkit", 3, "is_blank", "return text.strip() == \"\"", "return text == \"\"", "is_blank(\"   \")", "False",
        "True", "fix", "heldout"),
)


def problem_statement(bug: Bug) -> str:
    """The issue a user would file: the call, what came back, what was expected, the suspicious line."""
    module = MODULES[bug.package]
    text = (f"`{bug.func}()` returns the wrong result\n\n"
            f"```python\n>>> from {bug.package} import {bug.func}\n>>> {bug.call}\n{bug.got}\n```\n\n"
            f"I expected `{bug.want}`.\n\n"
            f"I think the problem is this line in `{module}`:\n\n```python\n    {bug.bad}\n```\n")
    if bug.hint == "fix":
        text += f"\nIt should probably be `{bug.good}`.\n"
    return text


@lru_cache(maxsize=None)
def _read_package(name: str) -> tuple[tuple[str, str], ...]:
    root = PACKAGES_DIR / name
    if not root.is_dir():
        raise ValueError(f"no starter package {name!r} in {PACKAGES_DIR}")
    paths = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    rels = [p.relative_to(root).as_posix() for p in paths]
    # The order of the record's `source.files` (part of the bundled JSONL): the package folder's
    # files first, then the top-level test file, each group sorted.
    ordered = sorted(r for r in rels if "/" in r) + sorted(r for r in rels if "/" not in r)
    return tuple((rel, (root / rel).read_bytes().decode("utf-8")) for rel in ordered)


def package_files(name: str) -> dict[str, str]:
    """{relative path: text} of the clean package `name` (e.g. "mathkit"), as the record's `source.files`.

    Raises ValueError for a package that is not under `packages/`.  Text is UTF-8, read byte for
    byte (no newline translation), so the base commit and patches match the bundled records.
    """
    return dict(_read_package(name))
