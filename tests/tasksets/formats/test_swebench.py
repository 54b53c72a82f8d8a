"""SWE-bench / Verified / SWE-Gym rows as published: eval script from swebench's own spec table."""
import json

import pytest

from app.tasksets.formats import detect_format
from app.tasksets.loader import TaskSetError, load_published, load_task_set
from support.format_fixtures import format_fixtures


@pytest.fixture
def fixtures(tmp_path):
    return format_fixtures(tmp_path / "formats")


def test_verified_row_gets_swebench_eval_script_parser_and_image(fixtures):
    records, _raws, warnings, counts = load_published(fixtures / "swebench_verified.jsonl")
    assert counts == {"swebench": 1} and warnings == []
    rec = records[0]
    assert rec.source_kind == "image" and rec.repo_dir == "/testbed" and rec.grader == "swebench"
    assert rec.image == "oci:/nonexistent-layout:fixture"  # the row's own image wins
    assert rec.log_parser == "parse_log_requests"  # swebench's parser for psf/requests
    script = rec.eval_script
    # swebench 4.1.0's script for requests 2.27: conda env, reset + apply the test patch, its test command
    assert "conda activate testbed" in script and "python -m pip install ." in script
    assert f"git checkout {rec.base_commit} tests/test_structures.py" in script
    assert "pytest -rA tests/test_structures.py" in script
    assert rec.FAIL_TO_PASS == ["tests/test_structures.py::TestLookupDict::test_contains"]


def test_default_image_is_swebench_name_and_swegym_its_own(fixtures, tmp_path):
    row = json.loads((fixtures / "swebench_verified.jsonl").read_text())
    del row["image"]
    for name, image in (("verified.jsonl", "swebench/sweb.eval.x86_64.psf_1776_requests-9001:latest"),
                        ("swe-gym.jsonl", "xingyaoww/sweb.eval.x86_64.psf_s_requests-9001:latest")):
        path = tmp_path / name
        path.write_text(json.dumps(row) + "\n")
        assert load_published(path)[0][0].image == image


def test_repo_or_version_unknown_to_swebench_is_named_at_load(fixtures, tmp_path):
    row = json.loads((fixtures / "swebench_verified.jsonl").read_text())
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({**row, "instance_id": "a__b-1", "repo": "nobody/nothing"}) + "\n"
                    + json.dumps({**row, "instance_id": "psf__requests-2", "version": "9.9"}) + "\n")
    with pytest.raises(TaskSetError) as info:
        load_published(path)
    text = str(info.value)
    assert "line 1 (instance_id='a__b-1'): field 'version'" in text and "repo 'nobody/nothing' is not in swebench 4.1.0" in text
    assert "line 2 (instance_id='psf__requests-2')" in text and "version '9.9' of psf/requests" in text


def test_unknown_keys_are_reported_not_dropped(fixtures, tmp_path):
    row = json.loads((fixtures / "swebench_verified.jsonl").read_text())
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({**row, "surprise": 1}) + "\n")
    ts = load_task_set(str(path))
    assert ts.warnings == ["set.jsonl line 1 (instance_id='psf__requests-9001'): unknown key(s) for SWE-bench: "
                           "'surprise' (kept on the record, not used)"]
    assert ts.instances[0].model_extra["surprise"] == 1


def test_rows_with_an_eval_script_stay_todays_records():
    assert detect_format({"instance_id": "x", "repo": "a/b", "base_commit": "abc1234", "FAIL_TO_PASS": "[]",
                          "version": "1", "eval_script": "pytest"}) == "turnstile"
