"""Harbor grading: fresh /tests and /logs/verifier (a planted reward is gone before the verifier runs)."""
from app.grading.harbor import fresh_verifier_dirs


def test_planted_reward_and_tests_are_erased(tmp_path):
    src = tmp_path / "task_tests"
    src.mkdir()
    (src / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    root = tmp_path / "rt"
    (root / "verifier").mkdir(parents=True)
    (root / "verifier" / "reward.txt").write_text("1")  # what an agent (or the image) left
    (root / "tests").mkdir()
    (root / "tests" / "test.sh").write_text("echo planted\n")
    (root / "tests" / "helper.sh").write_text("evil\n")
    tests, logs = fresh_verifier_dirs(root, src)
    assert list(logs.iterdir()) == []
    assert sorted(p.name for p in tests.iterdir()) == ["test.sh"]
    assert (tests / "test.sh").read_text() == "echo 1 > /logs/verifier/reward.txt\n"
