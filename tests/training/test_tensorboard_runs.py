"""TensorBoard run names: `<id>-<kind>-<harness>`, or `<id>-<name>` once a person names the run.

TensorBoard's own run discovery (`GetLogdirSubdirectories`, the Python loader's) reads the logdir
`<var_dir>/tensorboard/`; the events stay in `<var_dir>/runs/<id>/tensorboard/`, linked from it.
"""
from __future__ import annotations

import os

import pytest

from app import config
from app.db import session_scope
from app.paths import RunPaths
from app.tables import Run
from app.tensorboard_runs import link_all, logdir, run_name, tensorboard_url
from app.training.tracking import log_scalars


@pytest.fixture
def var(database, tmp_path, monkeypatch):
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    config.reset_settings()
    yield tmp_path / "var"
    config.reset_settings()


def _tensorboard_runs(folder) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{run name: {tag: [(step, value)]}} as TensorBoard's loader finds them under `folder`."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.backend.event_processing.io_wrapper import GetLogdirSubdirectories
    from tensorboard.util import tensor_util

    out: dict = {}
    for sub in GetLogdirSubdirectories(str(folder)):
        tags: dict = {}
        for path in sorted(p for p in os.listdir(sub) if "tfevents" in p):
            for event in EventFileLoader(os.path.join(sub, path)).Load():
                for value in event.summary.value:
                    tags.setdefault(value.tag, []).append(
                        (event.step, float(tensor_util.make_ndarray(value.tensor))))
        out[os.path.relpath(sub, folder)] = {k: sorted(v) for k, v in tags.items()}
    return out


def _new_run(**fields) -> int:
    with session_scope() as s:
        run = Run(kind="train", config={"harness": "mini-swe-agent"}, **fields)
        s.add(run)
        s.flush()
        return run.id


def test_a_run_is_listed_by_kind_and_harness_then_by_its_name(var):
    run_id = _new_run()
    log_scalars(run_id, {"train/loss": 0.5}, 0)
    assert _tensorboard_runs(logdir()) == {f"{run_id}-train-mini-swe-agent": {"train/loss": [(0, 0.5)]}}
    with session_scope() as s:
        s.get(Run, run_id).name = "lr 3e-5 / warm"
    log_scalars(run_id, {"train/loss": 0.25}, 1)
    # Renamed: every event of the run under the new name, the old name gone
    assert _tensorboard_runs(logdir()) == {f"{run_id}-lr-3e-5-warm": {"train/loss": [(0, 0.5), (1, 0.25)]}}
    assert list(RunPaths(run_id).tensorboard.glob("events.out.tfevents*"))  # the events stay in the run's folder


def test_runs_written_before_the_links_stay_readable(var):
    """Event folders of the old layout: a run in the database gets its name, one that is not (a
    stale folder, a wiped database) its folder's."""
    from tensorboard.summary import Writer

    run_id = _new_run(name="old")
    for folder in (str(run_id), "77", f"{run_id}.stale-20261201T000000-abcd"):
        writer = Writer(str(var / "runs" / folder / "tensorboard"))
        writer.add_scalar("eval/resolved_rate", 0.5, step=0)
        writer.close()
    with session_scope() as s:
        runs = [(r.id, r.kind, (r.config or {}).get("harness"), r.name) for r in s.query(Run)]
    assert link_all(runs) == 3
    assert sorted(_tensorboard_runs(logdir())) == sorted([f"{run_id}-old", "77", f"{run_id}.stale-20261201T000000-abcd"])
    assert link_all(runs) == 3  # again: nothing doubled


def test_names_and_links():
    assert run_name(4, "eval", "claude-code") == "4-eval-claude-code"
    assert run_name(4, "eval", "claude-code", "  ") == "4-eval-claude-code"
    assert run_name(4, None, None) == "4"
    assert tensorboard_url(None, 4, "eval", "pi") is None  # not configured: no link
    assert tensorboard_url("http://tb:6006/", 1, "train", "pi") == "http://tb:6006/?runFilter=%5E1-train-pi%24#timeseries"
    assert tensorboard_url("http://tb:6006", 2, "eval", "pi", "v1.0+x") == \
        "http://tb:6006/?runFilter=%5E2-v1%5C.0%5C%2Bx%24#timeseries"
