"""TensorBoard's run names: `<id>-<kind>-<harness>`, or `<id>-<name>` for a run a person named.

TensorBoard names a run by its folder's path under the logdir.  Event files stay in the run's own
folder (`<var_dir>/runs/<id>/tensorboard/`, `app.paths.RunPaths`: a stale folder set aside by
`app.control.runs.claim_run_dir` takes its events with it), and TensorBoard reads
`<var_dir>/tensorboard/` (the Procfile), which holds one relative symlink per run,

    <var_dir>/tensorboard/3-train-mini-swe-agent -> ../runs/3/tensorboard

so TensorBoard lists `3-train-mini-swe-agent` where it listed `3/tensorboard` before.  Both of
its loaders follow the link (checked with TensorBoard 2.21: the Rust data server and
`--load_fast=false`).  Renaming a run replaces its link: TensorBoard then shows every event of the
run under the new name, and the old one is gone.  The id prefix keeps two runs of one name apart
(a link, unlike a W&B display name, must be unique).  `link_all` makes the links of runs written
before this layout (`workers/tensorboard.py` runs it when TensorBoard starts).

Nothing here raises for a link it cannot make: tracking never fails a run.
"""
from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path

from app.config import get_settings
from app.paths import RunPaths

log = logging.getLogger("turnstile.tracking")

NAME_CHARS = re.compile(r"[^A-Za-z0-9._=+@-]+")  # what a run name keeps; the rest becomes "-"
NAME_MAX = 120


def logdir(var_dir: Path | None = None) -> Path:
    """The folder TensorBoard reads: `<var_dir>/tensorboard/`."""
    return Path(var_dir if var_dir is not None else get_settings().var_dir) / "tensorboard"


def _slug(text: str) -> str:
    return NAME_CHARS.sub("-", text).strip("-.")[:NAME_MAX].strip("-.")


def run_name(run_id: int, kind: str | None, harness: str | None, name: str | None = None) -> str:
    """The TensorBoard run name of a run: `<id>-<slug of name>` when it has a name (characters other
    than letters, digits and `._=+@-` become `-`), else `<id>-<kind>-<harness>` (`<id>` alone when
    neither is known, e.g. a run no longer in the database)."""
    given = _slug(name or "")
    if given:
        return f"{run_id}-{given}"
    parts = [_slug(p) for p in (kind or "", harness or "") if p and _slug(p)]
    return "-".join([str(run_id), *parts])


def _target(run_id: int) -> str:
    """The link's target, relative to the logdir (so a moved `var_dir` keeps working)."""
    return os.path.join("..", "runs", str(run_id), RunPaths(run_id, Path("/")).tensorboard.name)


def _links_of(folder: Path, run_id: int) -> list[Path]:
    """The links in `folder` that point at run `run_id`'s events (`<id>` or `<id>-...`)."""
    target = _target(run_id)
    found = []
    for path in [folder / str(run_id), *folder.glob(f"{run_id}-*")]:
        if path.is_symlink() and os.readlink(path) == target:
            found.append(path)
    return found


def link_run(run_id: int, kind: str | None, harness: str | None, name: str | None = None,
             var_dir: Path | None = None) -> Path | None:
    """Make `<logdir>/<run_name(...)>` the run's one link to its events; returns it, or None when
    the run has no events yet (the first write links it) or the link could not be made (logged).

    The new link is made in `<var_dir>/tmp/` and renamed into the logdir (rename(2) replaces a link
    atomically, and TensorBoard never sees a half-made one); the run's links of other names go after.
    """
    try:
        root = Path(var_dir if var_dir is not None else get_settings().var_dir)
        if not RunPaths(run_id, root).tensorboard.is_dir():
            return None
        folder, wanted = logdir(root), run_name(run_id, kind, harness, name)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / wanted
        if not (final.is_symlink() and os.readlink(final) == _target(run_id)):
            staging = root / "tmp"
            staging.mkdir(parents=True, exist_ok=True)
            temp = staging / f"tensorboard-link-{run_id}-{uuid.uuid4().hex[:8]}"
            os.symlink(_target(run_id), temp)
            os.replace(temp, final)
        for other in _links_of(folder, run_id):
            if other.name != wanted:
                other.unlink(missing_ok=True)
        return final
    except OSError:
        log.exception("run=%s event=tensorboard_link_failed", run_id)
        return None


def link_all(runs: list[tuple[int, str | None, str | None, str | None]], var_dir: Path | None = None) -> int:
    """Link every run of `runs` ((id, kind, harness, name), e.g. every run in the database) that has
    events, and every other `<var_dir>/runs/<folder>/tensorboard/` by its folder's name (a run no
    longer in the database, a stale folder set aside); returns how many links there are."""
    root = Path(var_dir if var_dir is not None else get_settings().var_dir)
    known = {run_id for run_id, *_ in runs}
    n = sum(1 for run in runs if link_run(*run, var_dir=root) is not None)
    runs_dir = root / "runs"
    for events in sorted(runs_dir.glob("*/tensorboard")) if runs_dir.is_dir() else []:
        folder = events.parent.name
        if folder.isdigit() and int(folder) in known or not events.is_dir():
            continue
        try:
            link = logdir(root) / folder
            logdir(root).mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                os.symlink(os.path.join("..", "runs", folder, "tensorboard"), link)
            n += 1
        except OSError:
            log.exception("folder=%s event=tensorboard_link_failed", folder)
    return n


def tensorboard_url(base: str | None, run_id: int, kind: str | None, harness: str | None,
                    name: str | None = None) -> str | None:
    """The TensorBoard page of the run (Time Series, filtered to its run name), or None when no
    TensorBoard address is configured.  `runFilter` is a regular expression over run names
    (TensorBoard's own query argument), anchored so run 1 does not also show run 11."""
    if not base:
        return None
    from urllib.parse import quote

    # A run name holds `._=+@-` besides letters and digits: only `.` and `+` mean something in a
    # JavaScript regular expression (TensorBoard's), and `\-` would be an error in its unicode mode.
    pattern = "^" + re.sub(r"([.+])", r"\\\1", run_name(run_id, kind, harness, name)) + "$"
    return f"{base.rstrip('/')}/?runFilter={quote(pattern, safe='')}#timeseries"
