"""Warm-start demonstrations that read the file first (`read_file`): for an issue that names the
suspicious line but not the fix, a `cat` turn shows the file as the agent finds it (bug in place)."""
from __future__ import annotations

import subprocess

import pytest

from app.engines.modeling import load_tokenizer
from app.harnesses import get_preset
from app.tasksets import load_task_set
from app.training.warmstart import buggy_file, demonstration, fix_command


@pytest.fixture(scope="module")
def line_record():
    return next(r for r in load_task_set("family").instances if r.difficulty == "family-line" and r.split == "train")


def test_buggy_file_is_the_file_with_the_bug_in_place(line_record, tmp_path):
    for rel, body in line_record.source.files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    subprocess.run(["git", "apply", "-"], input=line_record.bug_patch, text=True, cwd=tmp_path, check=True)
    path, text = buggy_file(line_record)
    assert text == (tmp_path / path).read_text() and text != line_record.source.files[path]


def test_a_read_demonstration_trains_the_cat_the_fix_and_the_submit(line_record):
    harness, tokenizer = get_preset("mini-swe-agent"), load_tokenizer()
    command = fix_command(line_record.patch)
    path, text = buggy_file(line_record)
    ids, mask = demonstration(tokenizer, harness, line_record.problem_statement, command, read=(path, text))
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained.count("<tool_call>") == 3 and f"cat {path}" in trained and harness.submit_command in trained
    untrained = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    header = next(line for line in text.splitlines() if line.startswith("def "))  # no quote for JSON to escape
    assert header in untrained and header not in trained  # the file is the tool's output, not a target
    plain, _ = demonstration(tokenizer, harness, line_record.problem_statement, command)
    assert len(plain) < len(ids)
