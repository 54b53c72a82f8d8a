"""Task sets: named sets, SWE-bench JSONL / HF JSON / parquet, validation errors, idempotent upsert."""
from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from app.db import session_scope
from app.tables import TaskInstance
from app.tasksets import (
    NAMED_SETS,
    InstanceRecord,
    TaskSetError,
    TaskSetNotFound,
    load_records,
    load_task_set,
    upsert_instances,
)

SHARED_REAL = NAMED_SETS["swebench-real"]


def _good(iid: str = "demo__pkg-1", **over) -> dict:
    rec = {
        "instance_id": iid, "repo": "demo/pkg", "base_commit": "a" * 40, "patch": "diff --git a/x b/x\n",
        "test_patch": "", "problem_statement": "it breaks", "FAIL_TO_PASS": json.dumps(["t.py::test_a"]),
        "PASS_TO_PASS": json.dumps(["t.py::test_b"]), "test_cmd": "python -m pytest -rA t.py", "test_files": ["t.py"],
    }
    rec.update(over)
    return rec


def test_bundled_synthetic_set_is_the_default_and_decodes_hf_string_lists():
    ts = load_task_set()
    assert ts.name == "synthetic"
    assert len(ts.instances) == 19
    first = ts.instances[0]
    # In the file FAIL_TO_PASS is a JSON string; the model holds a real list.
    raw_f2p = ts.raw[0]["FAIL_TO_PASS"]
    assert isinstance(raw_f2p, str) and first.FAIL_TO_PASS == json.loads(raw_f2p)
    assert first.source.kind == "pypi_sdist" and len(first.source.sha256) == 64
    assert all(r.bug_patch for r in ts.instances)


@pytest.mark.skipif(not SHARED_REAL.exists(), reason=f"{SHARED_REAL} is not present on this machine")
def test_swebench_real_set_is_read_from_shared_folder():
    ts = load_task_set("swebench-real")
    assert ts.path == SHARED_REAL
    assert {r.instance_id for r in ts.instances} >= {"pallets__flask-5014", "psf__requests-6028"}
    assert all(r.test_patch for r in ts.instances)


def test_unknown_name_is_a_clear_not_found(tmp_path):
    with pytest.raises(TaskSetNotFound, match="does not exist"):
        load_task_set(str(tmp_path / "nope.jsonl"))  # inside an allowed folder (the tests' temp folder)
    with pytest.raises(TaskSetNotFound, match="neither a named set .* nor a path inside an allowed folder"):
        load_task_set("/nope-not-a-task-set.jsonl")  # outside every allowed folder


def test_every_bad_record_is_reported_with_line_and_field(tmp_path):
    lines = [
        json.dumps(_good("ok__1")),
        "{not json",
        json.dumps(_good("bad__f2p", FAIL_TO_PASS="[\"unterminated")),
        json.dumps({k: v for k, v in _good("bad__missing").items() if k != "problem_statement"}),
        json.dumps(_good("bad__sha", source={"kind": "pypi_sdist", "name": "x", "version": "1", "sha256": "xyz"})),
        json.dumps(_good("ok__1")),
        json.dumps(_good("bad__parser", log_parser="parse_log_nonexistent")),
        "[1, 2]",
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskSetError) as info:
        load_records(path)
    got = {(e.line, e.field) for e in info.value.errors}
    assert got == {
        (2, "<line>"),
        (3, "FAIL_TO_PASS"),
        (4, "problem_statement"),
        (5, "source.pypi_sdist.sha256"),
        (6, "instance_id"),           # duplicate of line 1
        (7, "log_parser"),
        (8, "<record>"),
    }
    text = str(info.value)
    assert "set.jsonl line 3 (instance_id='bad__f2p'): field 'FAIL_TO_PASS'" in text
    assert "duplicate of line 1" in text


def test_records_that_grade_wrong_are_rejected_at_load_naming_the_instance(tmp_path):
    lines = [
        # No FAIL_TO_PASS test: an empty patch would resolve it.
        json.dumps(_good("empty__f2p", FAIL_TO_PASS="[]")),
        # swebench's parser collapses runs of spaces: this id can never pass.
        json.dumps(_good("double__space", PASS_TO_PASS=json.dumps(["t.py::test_b[a  b]"]))),
        # A FAILED line is cut at " - ": under fail_only this failing id would read as a pass.
        json.dumps(_good("dash__fail_only", FAIL_TO_PASS=json.dumps(["t.py::test_a[x - y]"]), eval_type="fail_only")),
        # The same id under pass_and_fail grades right (a cut FAILED id is missing = failed): kept.
        json.dumps(_good("dash__pass_and_fail", FAIL_TO_PASS=json.dumps(["t.py::test_a[x - y]"]))),
        '{"instance_id": "broken", "repo": "unterminated',
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TaskSetError) as info:
        load_records(path)
    got = {(e.line, e.instance_id, e.field) for e in info.value.errors}
    assert got == {(1, "empty__f2p", "FAIL_TO_PASS"), (2, "double__space", "PASS_TO_PASS"),
                   (3, "dash__fail_only", "FAIL_TO_PASS"), (5, None, "<line>")}
    text = str(info.value)
    assert "instance 'empty__f2p' has no FAIL_TO_PASS test, so an empty patch would resolve it" in text
    assert "'t.py::test_b[a  b]' is read back by parse_log_pytest_v2 as ['t.py::test_b[a b]']" in text
    assert "fail_only would count it as passed" in text
    assert "line 5: field '<line>': invalid JSON: Invalid control character at: column 48" in text
    assert "at at" not in text


def test_git_source_needs_a_commit_id(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(_good("g__1", base_commit="main")) + "\n")
    with pytest.raises(TaskSetError) as info:
        load_records(path)
    assert [(e.line, e.field) for e in info.value.errors] == [(1, "base_commit")]


def test_hf_json_array_and_parquet_folder_layouts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_good("hf__1"), _good("hf__2", FAIL_TO_PASS=json.dumps(["t.py::test_x", "t.py::test_y"]))]
    (tmp_path / "set.json").write_text(json.dumps(rows))
    recs, _raw = load_records(tmp_path / "set.json")
    assert [r.instance_id for r in recs] == ["hf__1", "hf__2"]

    folder = tmp_path / "hf" / "data"
    folder.mkdir(parents=True)
    # HF stores every column as a string, lists JSON-encoded.
    encoded = [{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows]
    table = pa.Table.from_pylist(encoded)
    pq.write_table(table, folder / "test-00000-of-00001.parquet")
    ts = load_task_set(str(tmp_path / "hf"))
    assert [r.FAIL_TO_PASS for r in ts.instances] == [["t.py::test_a"], ["t.py::test_x", "t.py::test_y"]]
    assert ts.instances[0].test_files == ["t.py"]

    bad = pa.Table.from_pylist([{**encoded[0], "test_files": "t.py"}, {**encoded[1], "instance_id": ""}])
    pq.write_table(bad, folder / "test-00000-of-00001.parquet")
    with pytest.raises(TaskSetError) as info:
        load_task_set(str(tmp_path / "hf"))
    assert {(e.line, e.field) for e in info.value.errors} == {(1, "test_files"), (2, "instance_id")}


def test_upsert_is_idempotent_and_updates(any_database):
    ts = load_task_set("synthetic")
    with session_scope() as s:
        first = upsert_instances(s, ts.name, ts.instances[:5])
    with session_scope() as s:
        again = upsert_instances(s, ts.name, ts.instances[:5])
        assert again == first
        assert s.scalar(select(func.count()).select_from(TaskInstance)) == 5
    changed = ts.raw[0] | {"problem_statement": "edited statement"}
    with session_scope() as s:
        ids = upsert_instances(s, ts.name, [changed])
        assert ids == {ts.instances[0].instance_id: first[ts.instances[0].instance_id]}
    with session_scope() as s:
        row = s.get(TaskInstance, first[ts.instances[0].instance_id])
        assert row.record["problem_statement"] == "edited statement"
        assert row.repo == "jpvanhal/inflection"
        assert row.base_commit == ts.instances[0].sdist_base_commit
        # Stored records validate again (what grade() and the pipeline read back).
        assert InstanceRecord.model_validate(row.record).FAIL_TO_PASS == ts.instances[0].FAIL_TO_PASS
        assert s.scalar(select(func.count()).select_from(TaskInstance)) == 5
