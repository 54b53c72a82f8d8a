"""The bundled `starter` family: generated packages as `inline` sources, built like sdists, split train/held-out.

Fast checks only (no pytest run of the packages): the grade of the gold and empty patch is
`python -m app tasks validate starter` (about 45 s per instance here).
"""
from __future__ import annotations

import subprocess

import pytest
from pydantic import ValidationError

from app import config
from app.config import get_settings
from app.runtimes import RuntimePaths, materialize_base
from app.tasksets import InstanceRecord, load_task_set
from app.tasksets import starter
from app.tasksets.starter import generate


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    config.reset_settings()
    yield get_settings()
    config.reset_settings()


def test_inline_base_is_one_commit_with_the_recorded_id_and_the_bug_in_place(settings):
    rec = load_task_set("starter").get("starter__tempkit-2")
    base = materialize_base(rec, RuntimePaths.from_settings(settings))
    log = subprocess.run(["git", "-C", str(base), "log", "--format=%H %an %s"], capture_output=True, text=True).stdout
    assert log.strip() == f"{rec.sdist_base_commit} sdist tempkit 1.0.0"
    assert "return c < 0" in (base / "tempkit" / "convert.py").read_text()
    assert subprocess.run(["git", "-C", str(base), "apply", "--check", "-"], input=rec.patch, text=True).returncode == 0
    assert subprocess.run(["git", "-C", str(base), "status", "--porcelain"], capture_output=True, text=True).stdout == ""


def test_bundled_records_match_the_generator_definitions():
    records = load_task_set("starter").raw
    assert [r["instance_id"] for r in records] == [b.instance_id for b in starter.BUGS]
    for record, bug in zip(records, starter.BUGS):
        assert record["source"]["files"] == starter.package_files(bug.package)  # same files, same order
        assert record["problem_statement"] == starter.problem_statement(bug)
        assert f"+    {bug.bad}\n" in record["bug_patch"] and f"+    {bug.good}\n" in record["patch"]
        assert record["split"] == bug.split


def test_splits_are_disjoint_and_heldout_has_packages_absent_from_train():
    records = load_task_set("starter").raw
    train, heldout = starter.split_ids(records, "train"), starter.split_ids(records, "heldout")
    assert train and heldout and not set(train) & set(heldout)
    assert len(train) + len(heldout) == len(records)
    package = {r["instance_id"]: r["source"]["name"] for r in records}
    assert {package[i] for i in heldout} - {package[i] for i in train} == {"tempkit", "checkkit"}


def test_package_files_are_read_from_the_packages_folder():
    files = starter.package_files("tempkit")
    assert list(files) == ["tempkit/__init__.py", "tempkit/convert.py", "test_tempkit.py"]
    assert "    return c <= 0\n" in files["tempkit/convert.py"]
    files["tempkit/convert.py"] = ""  # a copy: the next call reads the real text again
    assert starter.package_files("tempkit")["tempkit/convert.py"]
    with pytest.raises(ValueError, match="no starter package 'nokit'"):
        starter.package_files("nokit")


def test_instance_ids_reads_a_split_or_passes_a_list_through():
    records = load_task_set("starter").raw
    assert starter.instance_ids("starter:heldout") == starter.split_ids(records, "heldout")
    assert starter.instance_ids(("a", "b")) == ["a", "b"]
    with pytest.raises(ValueError, match="names no instance"):
        starter.instance_ids("starter:nosplit")


@pytest.mark.parametrize("path", ["/etc/passwd", "../up.py", "a//b.py", ".git/config", "pkg/../../x"])
def test_inline_file_paths_must_stay_inside_the_repository(path):
    rec = load_task_set("starter").raw[0]
    bad = {**rec, "source": {**rec["source"], "files": {path: "x = 1\n"}}}
    with pytest.raises(ValidationError, match="must be relative"):
        InstanceRecord.model_validate(bad)


def test_a_buggy_line_that_is_not_unique_is_refused():
    bug = starter.Bug("mathkit", 9, "add", "return a + b", "return a - b", "add(2, 3)", "-1", "5", "fix", "train")
    with pytest.raises(ValueError, match="must be unique"):
        generate._buggy_files(bug)


def test_gold_patch_resolves_and_empty_patch_does_not(tmp_path, monkeypatch):
    """One instance through the real grader (what `python -m app tasks validate starter` does for all 18).

    The environment cache is the checkout's (var/cache), so the venv (pytest only) is built once per machine.
    """
    from app.config import ROOT
    from app.grading.validate import check_instance

    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("TURNSTILE_CACHE_DIR", str(ROOT / "var" / "cache"))
    config.reset_settings()
    try:
        check = check_instance(load_task_set("starter").get("starter__checkkit-2"), timeout_s=120)
    finally:
        config.reset_settings()
    assert check.problems == []
    assert check.gold.resolved and not check.empty.resolved
