"""The reward watch: one write session by one process is a reward, anything else a verifier error.

Real inotify on real files, written here from the test's own process and from a second one (what
a verifier shell and the tested code do through the bind mount: inotify watches the inode, so
the path and mount a write comes through do not change what is seen).
"""
from __future__ import annotations

import functools
import os
import subprocess

import pytest

from app.grading.reward_watch import RewardWatch
from app.grading.verifier import REQUIRED_TOOLS, VerifierError, missing_tools, read_reward
from app.runtimes.rootfs import resolve_inside


def sh(script: str, folder) -> None:
    subprocess.run(["bash", "-c", script], cwd=folder, check=True)


def test_one_write_with_reads_around_it_is_the_reward(tmp_path):
    with RewardWatch(tmp_path / "r") as watch:
        sh("cat reward.txt; echo 0.5 > reward.txt; cat reward.txt reward.json", watch.folder)
        name = watch.verdict()
    assert name == "reward.txt" and read_reward(watch.folder, name)[0] == 0.5
    with RewardWatch(tmp_path / "j") as watch:
        (watch.folder / "reward.json").write_text('{"reward": 1}')
        assert read_reward(watch.folder, watch.verdict())[0] == 1.0


@pytest.mark.parametrize("script, why", [
    ("", "wrote no"),
    ("echo 1 > reward.txt; echo 0 > reward.txt", "written more than once"),
    ("echo 1 > reward.txt; chmod 444 reward.txt; chmod 644 reward.txt", "mode was changed"),
    ("echo 0 > reward.txt; echo 1 > reward.json", "both"),
    ("exec 3<>reward.txt; echo 0 > reward.txt; printf 1 >&3", "not written once"),
])
def test_anything_but_one_write_is_a_verifier_error(tmp_path, script, why):
    with RewardWatch(tmp_path / "r") as watch:
        sh(script, watch.folder)
        with pytest.raises(VerifierError, match=why):
            watch.verdict()


def test_a_flood_of_events_loses_track_and_is_refused(tmp_path):
    with RewardWatch(tmp_path / "r") as watch:
        watch._stop.set()  # the reader stops: the queue (16,384 events by default) overflows
        watch._thread.join()
        limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
        for _ in range(limit):
            open(watch.folder / "reward.txt", "w").close()
        watch._thread = None
        with pytest.raises(VerifierError, match="overflow"):
            watch.verdict()


def test_harbor_needs_git_or_a_gnu_patch(tmp_path):
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    for tool in ("bash", "timeout"):
        (root / "bin" / tool).write_text("x")
    (root / "bin" / "busybox").write_bytes(b"\x7fELF BusyBox v1.36 patch applet")
    os.symlink("busybox", root / "bin" / "patch")
    resolve = functools.partial(resolve_inside, root)
    assert missing_tools(resolve, REQUIRED_TOOLS["harbor"]) == ["git or GNU patch"]
    (root / "bin" / "patch").unlink()
    (root / "bin" / "patch").write_bytes(b"\x7fELF ... GNU patch %s\n")
    assert missing_tools(resolve, REQUIRED_TOOLS["harbor"]) == []
    (root / "bin" / "patch").unlink()
    (root / "bin" / "git").write_text("x")
    assert missing_tools(resolve, REQUIRED_TOOLS["harbor"]) == []
