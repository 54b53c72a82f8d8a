"""R2E-Gym rows: hidden tests in the image, exact-status reward."""
from app.tasksets.loader import load_published
from support.format_fixtures import format_fixtures


def test_row_maps_to_r2egym_grader_with_expected_statuses(tmp_path):
    rec = load_published(format_fixtures(tmp_path / "f") / "r2egym.jsonl")[0][0]
    assert rec.grader == "r2egym" and rec.test_cmd == "bash run_tests.sh"
    # R2E-Gym's layout: hidden tests at /r2e_tests, the runner in the repository; the episode sees neither.
    assert rec.model_extra["hidden_paths"] == ["/r2e_tests", "/testbed/run_tests.sh", "/testbed/r2e_tests"]
    assert "TestLookupDict.test_contains" in rec.expected_statuses  # keyed as R2E-Gym's parser keys them
    assert len(rec.expected_statuses) == 21 and set(rec.expected_statuses.values()) == {"PASSED"}
    assert rec.patch.startswith("diff --git a/requests/structures.py") and "tests/test_structures.py" not in rec.patch
    assert rec.instance_id == "requests__0123456789ab"
