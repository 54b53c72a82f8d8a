"""SWE-rebench V2 rows: install_config.test_cmd, a named parser, upstream's apply flags."""
import json

import pytest

from app.tasksets.loader import TaskSetError, load_published
from support.format_fixtures import format_fixtures


@pytest.fixture
def fixtures(tmp_path):
    return format_fixtures(tmp_path / "formats")


def test_row_maps_to_rebench_grader_with_its_test_cmd_and_parser(fixtures):
    records, _raws, warnings, counts = load_published(fixtures / "swerebench_v2.json")
    rec = records[0]
    assert counts == {"rebench": 1} and warnings == []
    assert rec.grader == "rebench" and rec.log_parser == "parse_log_pytest" and rec.repo_dir == "/testbed"
    assert "git apply -v --3way --recount --ignore-space-change --whitespace=nowarn - <<" in rec.eval_script
    assert "pytest -rA -p no:cacheprovider tests/test_structures.py" in rec.eval_script
    assert len(rec.PASS_TO_PASS) == 20 and rec.created_at == "1641340800000"


def test_workdir_defaults_to_the_repo_name_and_unknown_parser_is_refused(fixtures, tmp_path):
    row = json.loads((fixtures / "swerebench_v2.json").read_text())[0]
    del row["repo_dir"]
    bad = {**row, "instance_id": "x__y-2", "install_config": {**row["install_config"], "log_parser": "parse_log_pytest_nebo"}}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row]))
    assert load_published(path)[0][0].repo_dir == "/requests"  # upstream's /<repo name>
    path.write_text(json.dumps([bad]))
    with pytest.raises(TaskSetError, match="log parser 'parse_log_pytest_nebo' is SWE-rebench V2's own"):
        load_published(path)
