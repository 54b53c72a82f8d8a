"""The bundled `family` set: 160 one-line bugs of eight kinds in fourteen generated packages, split
train / held-out at random (same distribution) plus an out-of-family split of kinds absent from train.

"`tasks validate` holds for every instance" is checked here for all of them in-process (the gold
patch makes every FAIL_TO_PASS and PASS_TO_PASS test pass, the buggy tree fails every FAIL_TO_PASS
test and passes every PASS_TO_PASS one), and for one instance through the real grader, as
`python -m app tasks validate family` does for each (docs/learning.md has that run).
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from app import config
from app.tasksets import load_task_set
from app.tasksets.family import IN_FAMILY, OUT_OF_FAMILY, instances, mutate, packages
from app.tasksets.family.generate import HELDOUT, SPLIT_SEEDS, hints, problem_statement, splits
from app.tasksets.starter import instance_ids
from app.tasksets.starter.splits import spec_ids


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_task_set("family").raw


def test_the_family_is_large_enough_and_its_splits_share_a_distribution(records):
    assert len(records) >= 120 and len({r["source"]["name"] for r in records}) >= 12
    by_split = {s: [r for r in records if r["split"] == s] for s in ("train", "heldout", "out_of_family")}
    assert len(by_split["heldout"]) == HELDOUT >= 40 and len(by_split["train"]) >= 80
    assert sum(map(len, by_split.values())) == len(records)
    for seed in map(str, SPLIT_SEEDS):
        train = [r for r in records if r["splits"][seed] == "train"]
        held = [r for r in records if r["splits"][seed] == "heldout"]
        # every in-family kind and both kinds of issue text occur on both sides; no out-of-family kind in train
        for side in (train, held):
            assert {r["bug_kind"] for r in side} == set(IN_FAMILY)
            assert {r["difficulty"] for r in side} == {"family-fix", "family-line"}
        assert len({r["source"]["name"] for r in held}) >= 12
        assert not {r["bug_kind"] for r in train} & set(OUT_OF_FAMILY)
    assert {r["bug_kind"] for r in by_split["out_of_family"]} == set(OUT_OF_FAMILY)
    seed0 = {r["instance_id"] for r in records if r["splits"]["0"] == "heldout"}
    seed1 = {r["instance_id"] for r in records if r["splits"]["1"] == "heldout"}
    assert seed0 != seed1 and seed0 & seed1  # two random draws of one split rule


def test_bundled_records_match_the_generator(records):
    every = instances()
    assert [r["instance_id"] for r in records] == [i.instance_id for i in every]
    hint = hints(every)
    split0 = splits(every, 0)
    for record, inst in zip(records, every):
        assert record["source"]["files"] == inst.package.files()
        assert record["problem_statement"] == problem_statement(inst, hint[inst.instance_id])
        assert f"+    {inst.bad}\n" in record["bug_patch"] and f"+    {inst.good}\n" in record["patch"]
        assert record["split"] == split0[inst.instance_id] and record["bug_kind"] == inst.kind
    fix = [r for r in records if r["difficulty"] == "family-fix"]
    assert fix and all("It should probably be" in r["problem_statement"] for r in fix)
    assert all("It should probably be" not in r["problem_statement"] for r in records if r not in fix)


def test_each_package_has_its_own_functions_and_each_kind_rewrites_one_spot():
    names = [f.name for p in packages() for f in p.funcs]
    assert len(names) == len(set(names))
    assert mutate("operator", "n + 2 - n % 2") == ["n - 2 - n % 2", "n + 2 + n % 2", "n + 2 - n // 2"]
    assert mutate("index", "items[-1]") == ["items[-2]"]
    assert mutate("drop_call", "round(part / whole * 100, 1)") == ["part / whole * 100"]
    assert mutate("swap", "a - b") == ["b - a"] and mutate("logic", "not items") == ["items"]
    with pytest.raises(ValueError, match="unknown bug kind"):
        mutate("typo", "x")


def _outcomes(root: Path, package: str, test_file: str) -> dict[str, str]:
    """{test id: PASSED | FAILED} of the tree at `root`, its test functions called in-process."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".") or m == test_file[:-3]]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(test_file[:-3])
        out = {}
        for name in sorted(n for n in dir(module) if n.startswith("test_")):
            try:
                getattr(module, name)()
                out[f"{test_file}::{name}"] = "PASSED"
            except Exception:  # noqa: BLE001 - any exception fails the test, as under pytest
                out[f"{test_file}::{name}"] = "FAILED"
        return out
    finally:
        sys.path.remove(str(root))


def _tree(tmp: Path, record: dict, patches: list[str]) -> Path:
    root = tmp / record["instance_id"] / str(len(patches))
    for rel, text in record["source"]["files"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for patch in patches:
        subprocess.run(["git", "apply", "-"], cwd=root, input=patch, text=True, check=True)
    return root


def test_every_gold_patch_resolves_and_every_empty_patch_does_not(records, tmp_path):
    counts = Counter()
    for record in records:
        package, test_file = record["source"]["name"], record["test_files"][0]
        f2p, p2p = json.loads(record["FAIL_TO_PASS"]), json.loads(record["PASS_TO_PASS"])
        assert f2p, record["instance_id"]
        buggy = _outcomes(_tree(tmp_path, record, [record["bug_patch"]]), package, test_file)
        gold = _outcomes(_tree(tmp_path, record, [record["bug_patch"], record["patch"]]), package, test_file)
        assert all(gold[t] == "PASSED" for t in f2p + p2p), record["instance_id"]
        assert all(buggy[t] == "FAILED" for t in f2p) and all(buggy[t] == "PASSED" for t in p2p), record["instance_id"]
        counts["checked"] += 1
    assert counts["checked"] == len(records)


def test_one_instance_through_the_real_grader(tmp_path, monkeypatch):
    from app.config import ROOT
    from app.grading.validate import check_instance

    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
    config.reset_settings()
    try:
        record = next(r for r in load_task_set("family").instances if r.split == "heldout")
        check = check_instance(record, timeout_s=120)
    finally:
        config.reset_settings()
    assert check.problems == []
    assert check.gold.resolved and not check.empty.resolved


def test_split_specs_name_a_split_under_a_seed_and_refuse_what_does_not_exist(records):
    assert instance_ids("family:heldout") == [r["instance_id"] for r in records if r["split"] == "heldout"]
    assert instance_ids("family:train@1") == [r["instance_id"] for r in records if r["splits"]["1"] == "train"]
    assert spec_ids(records, "family:out_of_family@0") == spec_ids(records, "family:out_of_family@1")
    with pytest.raises(ValueError, match="has split seeds 0, 1, not '7'"):
        instance_ids("family:heldout@7")
    with pytest.raises(ValueError, match="has splits heldout, out_of_family, train, not 'test'"):
        instance_ids("family:test")
    with pytest.raises(ValueError, match="is not a split spec"):
        instance_ids("family")
