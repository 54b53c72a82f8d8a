"""Where a run keeps its files: the one home of the layout under `<var_dir>/runs/<run_id>/`.

    run.json                                   which database and creation time own this folder
    train.lock                                 held (flock) by the process training this run
    checkpoints/step_<k>/                      checkpoint after training step k (app.training.checkpoints)
    tensorboard/                               TensorBoard event files (app.training.tracking)
    wandb/                                     W&B's files (W&B makes `wandb/` under the run folder)
    episodes/<episode_id>/harness-attempt<N>.log   the harness's output of attempt N
    trajectories.jsonl                         `python -m app train`'s export of the run
    compare.json, learning.png                 `python -m app learn`'s comparison and figure

Nothing here creates a folder: the writer of a file makes its parent.  State files are written
with `write_atomic` (temp file, fsync, rename), so a reader sees the old file or the new one,
never a part of either (a full disk leaves the old file, or none).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from app.config import get_settings

HARNESS_LOG_PREFIX = "harness-attempt"


def write_atomic(path: Path | str, data: str | bytes, encoding: str = "utf-8") -> None:
    """Replace `path` with `data` (text is encoded with `encoding`) all at once.

    Writes a temporary file next to `path`, fsyncs it, renames it over `path` (POSIX rename(2)
    is atomic within one file system) and fsyncs the folder, so the rename survives a crash.
    The parent folder must exist.  Raises the `OSError` of the write (ENOSPC on a full disk, ...)
    after removing the temporary file: `path` is then left as it was.
    """
    path = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class RunPaths:
    """The paths of run `run_id`'s folder, under `var_dir` (default: the settings' `var_dir`, read now)."""

    def __init__(self, run_id: int, var_dir: Path | None = None):
        self.run_id = int(run_id)
        self.root = Path(var_dir if var_dir is not None else get_settings().var_dir) / "runs" / str(self.run_id)

    def __repr__(self) -> str:
        return f"RunPaths({self.run_id}, root={str(self.root)!r})"

    @property
    def identity(self) -> Path:
        """`run.json`: the database URL and creation time of the run that owns the folder."""
        return self.root / "run.json"

    @property
    def train_lock(self) -> Path:
        return self.root / "train.lock"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        """The folder of the checkpoint written after training step `step` (0-based)."""
        return self.checkpoints / f"step_{step}"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """W&B's own folder: `wandb.init(dir=root)` writes here, so W&B is given `root`, not this."""
        return self.root / "wandb"

    def episode(self, episode_id: int) -> Path:
        return self.root / "episodes" / str(episode_id)

    def harness_log(self, episode_id: int, attempt: int) -> Path:
        """The harness output of episode `episode_id`'s attempt `attempt` (1-based, `Episode.attempts`)."""
        return self.episode(episode_id) / f"{HARNESS_LOG_PREFIX}{attempt}.log"

    def harness_logs(self, episode_id: int) -> list[tuple[int | str, Path]]:
        """(attempt, path) of every harness log of the episode, in no particular order; an attempt
        whose file name does not end in a number is given as the text it has."""
        out: list[tuple[int | str, Path]] = []
        for path in self.episode(episode_id).glob(f"{HARNESS_LOG_PREFIX}*.log"):
            attempt = path.stem.removeprefix(HARNESS_LOG_PREFIX)
            out.append((int(attempt) if attempt.isdigit() else attempt, path))
        return out

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories.jsonl"

    @property
    def compare(self) -> Path:
        return self.root / "compare.json"

    @property
    def learning_png(self) -> Path:
        return self.root / "learning.png"
