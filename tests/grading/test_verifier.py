"""Pure parts of grading in an image: reward files, missing tools, R2E-Gym and SWE-rebench V2 rules."""
import json

import pytest

from app.grading.verifier import VerifierError, missing_tools, r2e_match, read_reward, rebench_match
from app.runtimes.errors import RuntimeSetupError


def test_reward_txt_and_json(tmp_path):
    (tmp_path / "reward.txt").write_text("0.75\n")
    assert read_reward(tmp_path)[0] == 0.75
    (tmp_path / "reward.txt").unlink()
    (tmp_path / "reward.json").write_text(json.dumps({"reward": 1}))
    assert read_reward(tmp_path) == (1.0, {"file": "reward.json", "rewards": {"reward": 1}})
    (tmp_path / "reward.json").write_text(json.dumps({"tests": 0.5}))
    assert read_reward(tmp_path)[0] == 0.5


@pytest.mark.parametrize("name, text, message", [
    (None, None, "wrote no /logs/verifier/reward.txt"),
    ("reward.txt", "yes", "not a number"),
    ("reward.txt", "nan", "not finite"),
    ("reward.json", '{"a": 1, "b": 0}', "none named 'reward'"),
    ("reward.json", '{"reward": "1"}', "not a number"),
])
def test_unreadable_reward_is_a_verifier_error_not_zero(tmp_path, name, text, message):
    if name:
        (tmp_path / name).write_text(text)
    with pytest.raises(VerifierError, match=message) as info:
        read_reward(tmp_path)
    assert isinstance(info.value, RuntimeSetupError) and info.value.stage == "verifier_error"


def test_a_linked_reward_file_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_text("1")
    (tmp_path / "reward.txt").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(VerifierError, match="not a plain file"):
        read_reward(tmp_path)


def test_missing_tools_looks_in_the_images_path(tmp_path):
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "bash").write_text("")
    resolve = lambda p: tmp_path / p.lstrip("/") if (tmp_path / p.lstrip("/")).exists() else None  # noqa: E731
    assert missing_tools(resolve, ["bash", "timeout"]) == ["timeout"]


def test_r2e_and_rebench_rules():
    expected = {"t.py::a": "PASSED", "t.py::b": "FAILED"}
    assert r2e_match({"t.py::a": "PASSED", "t.py::b - boom": "FAILED"}, expected)[0]
    ok, diff = r2e_match({"t.py::a": "PASSED", "t.py::c": "PASSED"}, expected)
    assert not ok and diff == {"missing": ["b"], "unexpected": ["c"], "different": []}
    # Published R2E-Gym rows key tests as its parser does (`Class.test`, no file part).
    assert r2e_match({"r2e_tests/test_1.py::TestX::test_a": "PASSED"}, {"TestX.test_a": "PASSED"})[0]
    assert not r2e_match({"r2e_tests/test_1.py::TestX::test_a": "FAILED"}, {"TestX.test_a": "PASSED"})[0]
    assert rebench_match({"a": "PASSED", "b": "PASSED", "c": "FAILED"}, ["a"], ["b"])
    assert not rebench_match({"a": "PASSED", "b": "PASSED", "x": "PASSED"}, ["a"], ["b"])  # exactly, as upstream
