"""Atomic, resumable checkpoints and the run's training lock.

Layout under `<var_dir>/runs/<run_id>/` (the paths themselves: `app.paths.RunPaths`):

    checkpoints/step_<k>/model/               weights after step k (what engines load)
    checkpoints/step_<k>/optimizer.pt         AdamW state (resume)
    checkpoints/step_<k>/adapter.pt           LoRA adapters (LoRA runs only)
    checkpoints/step_<k>/adapter/             the same, as engines serve them per request (LoRA runs)
    checkpoints/step_<k>/trainer_state.json   step, policy_version, metrics, episode_ids
    tensorboard/                              event files, one scalar per metric per step
    train.lock                                held (flock) by the process training this run

A checkpoint is written into a hidden temporary sibling, fsynced and renamed into place, so
`step_<k>` exists only when complete; resume picks the highest complete k
(a crash mid-write leaves only the hidden temporary, never a half checkpoint).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterator

from app.paths import RunPaths

KEEP_CHECKPOINTS = 3  # newest complete checkpoints kept; older ones are deleted after each step
_STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_checkpoints(run_id: int) -> list[tuple[int, Path]]:
    """`(step, path)` of every complete checkpoint of the run, oldest first."""
    root = RunPaths(run_id).checkpoints
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / "trainer_state.json").is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def resolve_checkpoint(spec: str) -> tuple[Path, int]:
    """(model folder, policy version) of `spec`: a model folder, or 'run:<id>' for that run's newest checkpoint.

    The version comes from the folder's `turnstile.json` (0 when absent).
    Raises FileNotFoundError when there is no such checkpoint.
    """
    if spec.startswith("run:"):
        run_id = spec.removeprefix("run:")
        if not run_id.isdigit():
            raise FileNotFoundError(f"{spec}: expected run:<id> with a numeric run id")
        root = RunPaths(int(run_id)).checkpoints
        steps = sorted((p for p in root.glob("step_*") if (p / "model").is_dir() and _STEP_DIR.match(p.name)),
                       key=lambda p: int(p.name.removeprefix("step_")))
        if not steps:
            raise FileNotFoundError(f"{spec}: no checkpoint under {root}")
        folder = steps[-1] / "model"
    else:
        folder = Path(spec)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    meta = folder / "turnstile.json"
    version = json.loads(meta.read_text()).get("policy_version", 0) if meta.is_file() else 0
    return folder, int(version or 0)


def write_checkpoint(final: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)` and publish `tmp_dir` as `final` atomically; returns `final`.

    An existing `final` (a step redone after a crash) is replaced.  On error the temporary
    directory is removed and the exception propagates.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():
            aside = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune_checkpoints(run_id: int, keep: int = KEEP_CHECKPOINTS) -> None:
    """Delete all but the newest `keep` complete checkpoints and any leftover temporaries."""
    root = RunPaths(run_id).checkpoints
    for _step, path in complete_checkpoints(run_id)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".step_") and ".tmp-" in entry.name:
                pid = entry.name.split(".tmp-")[1].split("-")[0]
                if pid.isdigit() and not _alive(int(pid)):
                    shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def run_lock(run_id: int) -> Iterator[bool]:
    """Non-blocking exclusive flock on the run's `train.lock`; yields whether it was acquired.

    The kernel drops the lock when the holder dies, so a killed gpu worker never leaves a
    stale lock behind, while a second live process cannot train the same run concurrently.
    """
    path = RunPaths(run_id).train_lock
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
