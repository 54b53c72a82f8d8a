"""R2E-Gym rows: hidden tests in the image, exact-status reward."""
from app.tasksets.loader import load_published
from support.format_fixtures import format_fixtures


def test_row_maps_to_r2egym_grader_with_expected_statuses(tmp_path):
    rec = load_published(format_fixtures(tmp_path / "f") / "r2egym.jsonl")[0][0]
    assert rec.grader == "r2egym" and rec.test_cmd == "bash /run_tests.sh"
    assert len(rec.expected_statuses) == 21 and set(rec.expected_statuses.values()) == {"PASSED"}
    assert rec.patch.startswith("diff --git a/requests/structures.py") and "tests/test_structures.py" not in rec.patch
    assert rec.instance_id == "requests__0123456789ab"
