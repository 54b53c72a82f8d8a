"""Harbor task folders: task.toml via tomllib, prebuilt image required, unknown keys reported."""
import pytest

from app.tasksets.loader import TaskSetError, load_published
from support.format_fixtures import format_fixtures


@pytest.fixture
def fixtures(tmp_path):
    return format_fixtures(tmp_path / "formats")


def test_task_folder_and_dataset_folder_load(fixtures):
    for path in (fixtures / "harbor" / "requests-lookup-contains", fixtures / "harbor"):
        records, _raws, warnings, counts = load_published(path)
        assert counts == {"harbor": 1} and warnings == []
        rec = records[0]
        assert rec.grader == "harbor" and rec.instance_id == "turnstile__requests-lookup-contains"
        assert rec.repo_dir == "/testbed" and rec.image == "oci:/nonexistent-layout:fixture"
        assert rec.harbor.verifier_timeout_s == 300 and rec.harbor.agent_timeout_s == 600
        assert rec.harbor.oracle.endswith("solution/solve.sh") and rec.harbor.tests_dir.endswith("/tests")
        assert "LookupDict" in rec.problem_statement


def test_dockerfile_only_task_is_refused_needing_a_built_image(fixtures):
    with pytest.raises(TaskSetError, match="needs a built image: only environment/Dockerfile"):
        load_published(fixtures / "harbor-unbuilt")


def test_unknown_task_toml_keys_are_reported(fixtures):
    toml = fixtures / "harbor" / "requests-lookup-contains" / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", "[verifier]\nmystery = 3\n") + "\n[extras]\na = 1\n")
    _records, _raws, warnings, _counts = load_published(toml.parent)
    assert warnings == ["requests-lookup-contains line 1 (instance_id='requests-lookup-contains'): unknown task.toml key 'extras'",
                        "requests-lookup-contains line 1 (instance_id='requests-lookup-contains'): unknown task.toml key [verifier] 'mystery'"]
