"""Build the `family` records (SWE-bench format) and write data/tasks/family.jsonl.

    python -m app.tasksets.family            # writes data/tasks/family.jsonl
    python -m app.tasksets.family --check    # exit 1 when the bundled file differs from what it would write

Records are built as the starter set's are (`app.tasksets.starter.generate`): the package
travels inline, `bug_patch` plants the bug, `patch` is its reverse, FAIL_TO_PASS / PASS_TO_PASS
are read from pytest runs of the clean and the buggy tree, and the base commit is the one
`app.runtimes.materialize` builds.  Splits: the in-family instances (`IN_FAMILY` kinds) are
shuffled by each seed of `SPLIT_SEEDS` and cut into `HELDOUT` held-out and the rest train;
every instance of an `OUT_OF_FAMILY` kind is in the `out_of_family` split under every seed.
`split` is seed 0's; `splits` maps each seed (as a string) to the instance's split.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.tasksets.family.packages import Instance, Package, instances
from app.tasksets.starter import generate as starter_generate

OUT = Path(__file__).resolve().parents[3] / "data" / "tasks" / "family.jsonl"
VERSION = starter_generate.VERSION  # the base commit's message names it (`_base_commit`), so the two agree
SPLIT_SEEDS = (0, 1)
HELDOUT = 50  # in-family instances held out under each seed; the rest are train
HINT_SEED = 7


def problem_statement(inst: Instance, hint: str) -> str:
    """The issue a user would file: the call, what came back, what was expected, the suspicious line;
    with `hint == "fix"` also what the line should be."""
    text = (f"`{inst.func.name}()` returns the wrong result\n\n"
            f"```python\n>>> from {inst.package.name} import {inst.func.name}\n>>> {inst.call}\n{inst.got}\n```\n\n"
            f"I expected `{inst.want}`.\n\n"
            f"I think the problem is this line in `{inst.package.module}`:\n\n```python\n    {inst.bad}\n```\n")
    if hint == "fix":
        text += f"\nIt should probably be `{inst.good}`.\n"
    return text


def hints(all_instances: tuple[Instance, ...]) -> dict[str, str]:
    """{instance id: "fix" | "line"}: half of each bug kind gets each, at random (seed `HINT_SEED`)."""
    out: dict[str, str] = {}
    rng = random.Random(HINT_SEED)
    for kind in sorted({i.kind for i in all_instances}):
        ids = sorted(i.instance_id for i in all_instances if i.kind == kind)
        rng.shuffle(ids)
        out.update({name: ("fix" if n % 2 == 0 else "line") for n, name in enumerate(ids)})
    return out


def splits(all_instances: tuple[Instance, ...], seed: int) -> dict[str, str]:
    """{instance id: "train" | "heldout" | "out_of_family"} under split seed `seed`."""
    family = sorted(i.instance_id for i in all_instances if i.in_family)
    random.Random(f"family-split-{seed}").shuffle(family)
    out = {name: ("heldout" if n < HELDOUT else "train") for n, name in enumerate(family)}
    out.update({i.instance_id: "out_of_family" for i in all_instances if not i.in_family})
    return out


_CLEAN: dict[str, dict[str, str]] = {}


def _clean_outcomes(pkg: Package) -> dict[str, str]:
    """pytest outcomes of the clean package (one run per package name, shared by its instances)."""
    if pkg.name not in _CLEAN:
        _CLEAN[pkg.name] = starter_generate._test_outcomes(pkg.files(), pkg.test_file, plugins=False)
    return _CLEAN[pkg.name]


def build_record(inst: Instance, hint: str, split_of: dict[str, str]) -> dict:
    """The SWE-bench-format record of one instance (see the module docstring)."""
    pkg = inst.package
    clean, buggy = pkg.files(), pkg.files((inst.good, inst.bad))
    bug_patch, gold = starter_generate._diff(clean, buggy), starter_generate._diff(buggy, clean)
    good = _clean_outcomes(pkg)
    bad = starter_generate._test_outcomes(buggy, pkg.test_file, plugins=False)
    if any(v != "PASSED" for v in good.values()):
        raise RuntimeError(f"{inst.instance_id}: the clean package fails its own tests: {good}")
    f2p = sorted(t for t in good if bad.get(t) != "PASSED")
    p2p = sorted(t for t in good if bad.get(t) == "PASSED")
    if not f2p:
        raise RuntimeError(f"{inst.instance_id}: no test catches the bug")
    test_cmd, eval_script = starter_generate.test_scripts(pkg.test_file)
    commit = starter_generate._base_commit(pkg.name, clean, bug_patch)
    return {
        "instance_id": inst.instance_id, "repo": f"turnstile-family/{pkg.name}", "base_commit": commit,
        "patch": gold, "test_patch": "", "problem_statement": problem_statement(inst, hint), "hints_text": "",
        "created_at": starter_generate.CREATED_AT, "version": VERSION, "FAIL_TO_PASS": json.dumps(f2p),
        "PASS_TO_PASS": json.dumps(p2p), "environment_setup_commit": commit, "image": "", "eval_script": eval_script,
        "log_parser": "parse_log_pytest_v2", "eval_type": "pass_and_fail",
        "install": [f"python -m pip install -q {starter_generate.PYTEST_PIN}"], "test_cmd": test_cmd,
        "test_files": [pkg.test_file], "python": "3.11",
        "source": {"kind": "inline", "name": pkg.name, "version": VERSION, "files": clean},
        "bug_patch": bug_patch, "difficulty": "family-" + hint, "bug_kind": inst.kind,
        "split": split_of["0"], "splits": split_of,
        "provenance": "Generated by app/tasksets/family: a one-line bug of one kind planted in a small generated "
                      "package; FAIL_TO_PASS / PASS_TO_PASS read from pytest runs of the clean and buggy trees.",
        "sdist_base_commit": commit,
    }


def build_all(jobs: int = 2) -> list[dict]:
    """Every instance's record, in `instances()` order (pytest runs `jobs` at a time)."""
    every = instances()
    hint = hints(every)
    by_seed = {str(seed): splits(every, seed) for seed in SPLIT_SEEDS}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda i: build_record(i, hint[i.instance_id],
                                                    {s: by_seed[s][i.instance_id] for s in by_seed}), every))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tasksets.family", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="exit 1 when --out differs from what would be written")
    parser.add_argument("--jobs", type=int, default=2, help="pytest runs at a time")
    args = parser.parse_args(argv)
    text = starter_generate.render(build_all(args.jobs))
    if args.check:
        same = args.out.exists() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'differs from the generator'}")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {text.count(chr(10))} instances to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
