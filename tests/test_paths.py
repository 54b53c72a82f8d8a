"""A run's folder layout has one home (`app.paths.RunPaths`): the writers and readers of each file agree on it."""
from __future__ import annotations

import json
import subprocess

import pytest

from app import config
from app.control.runs import claim_run_dir
from app.paths import RunPaths
from app.training import checkpoints


@pytest.fixture
def var(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    config.reset_settings()
    yield (tmp_path / "var").resolve()
    config.reset_settings()


def test_run_folder_is_under_the_settings_var_dir(var, tmp_path):
    paths = RunPaths(7)
    assert paths.root == var / "runs" / "7"
    assert RunPaths("7").root == paths.root  # an id from JSON or a URL names the same folder
    assert RunPaths(7, var_dir=tmp_path / "elsewhere").root == tmp_path / "elsewhere" / "runs" / "7"
    assert [p.relative_to(paths.root).as_posix() for p in (
        paths.identity, paths.train_lock, paths.checkpoint(3), paths.tensorboard, paths.wandb,
        paths.harness_log(12, 2), paths.trajectories, paths.compare, paths.learning_png)] == [
        "run.json", "train.lock", "checkpoints/step_3", "tensorboard", "wandb",
        "episodes/12/harness-attempt2.log", "trajectories.jsonl", "compare.json", "learning.png"]
    assert not paths.root.exists()  # naming a path creates nothing


def test_claiming_a_folder_writes_its_identity_where_run_paths_says(var):
    claim_run_dir(5, "2024-01-01T00:00:00+00:00")
    identity = json.loads(RunPaths(5).identity.read_text())
    assert identity == {"database": config.get_settings().database_url, "created_at": "2024-01-01T00:00:00+00:00"}


def test_checkpoints_are_found_where_they_are_written(var):
    def write(tmp):
        (tmp / "model").mkdir(parents=True)
        (tmp / "model" / "turnstile.json").write_text(json.dumps({"policy_version": 2}))
        (tmp / "trainer_state.json").write_text("{}")

    for step in (0, 1):
        checkpoints.write_checkpoint(RunPaths(9).checkpoint(step), write)
    assert checkpoints.complete_checkpoints(9) == [(0, RunPaths(9).checkpoint(0)), (1, RunPaths(9).checkpoint(1))]
    assert checkpoints.resolve_checkpoint("run:9") == (RunPaths(9).checkpoint(1) / "model", 2)
    with checkpoints.run_lock(9) as held:
        assert held and RunPaths(9).train_lock.is_file()


def test_harness_logs_are_listed_by_attempt(var):
    paths = RunPaths(3)
    for attempt in (1, 2):
        paths.harness_log(40, attempt).parent.mkdir(parents=True, exist_ok=True)
        paths.harness_log(40, attempt).write_text(f"attempt {attempt}\n")
    (paths.episode(40) / "harness-attemptX.log").write_text("odd name\n")
    (paths.episode(40) / "notes.txt").write_text("not a harness log\n")
    assert sorted(paths.harness_logs(40), key=str) == sorted(
        [(1, paths.harness_log(40, 1)), (2, paths.harness_log(40, 2)), ("X", paths.episode(40) / "harness-attemptX.log")],
        key=str)
    assert paths.harness_logs(41) == []  # an episode that never ran its harness


def test_write_atomic_replaces_the_file_whole_and_leaves_it_on_a_full_disk(tmp_path):
    """On a real 1 MiB tmpfs filled to the last byte: the write fails with ENOSPC, the old file is
    left as it was and no temporary file stays; once space returns the new content lands whole."""
    import errno

    from app.paths import write_atomic
    from support.faults import full_disk

    disk = tmp_path / "disk"
    target = disk / "run.json"
    with full_disk(disk) as fill:
        fill.unlink()
        write_atomic(target, json.dumps({"v": 1}))
        assert json.loads(target.read_text()) == {"v": 1}
        subprocess.run(["dd", "if=/dev/zero", f"of={fill}", "bs=64k"], capture_output=True)
        with pytest.raises(OSError) as raised:
            write_atomic(target, json.dumps({"v": 2, "pad": "x" * 8192}))
        assert raised.value.errno == errno.ENOSPC
        assert json.loads(target.read_text()) == {"v": 1}
        assert sorted(p.name for p in disk.iterdir()) == ["fill", "run.json"]
        fill.unlink()
        write_atomic(target, b'{"v": 3}')
        assert json.loads(target.read_text()) == {"v": 3}
        assert sorted(p.name for p in disk.iterdir()) == ["run.json"]
