"""`turnstile follow` shows the trainer: each state of the next step, the held-out eval's progress
and one line per trained step, read from the real API app (over WSGI) on a real database; the
trainer's states are written to SQL as the scheduler and `app.training.steps` write them."""
from __future__ import annotations

import datetime as dt
import re

import pytest

from app.cli import client as cli_client
from app.cli import main
from app.control import heldout
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Episode, Group, Run, TaskInstance, TrainingStep
from support import AUTH

TRAIN = {"kind": "train", "group_size": 2, "tasks_per_step": 2, "steps": 2, "eval_every": 1, "eval_first": False,
         "eval_instances": ["sim-h0", "sim-h1"], "eval_samples": 2,
         "simulate": {"episode_median_s": 0.05, "train_s": 0.1, "reward_p": 0.5}}
METRICS = {"reward_mean": 0.5, "loss": -0.0077, "logprob_gap_max_abs": 0.0021, "logprob_gap_mean_abs": 0.00031,
           "step_time_s": 12.5}


def _ago(seconds: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds)


def _seed() -> tuple[int, int]:
    """A running train run with one of the two groups its step 0 needs accepted."""
    cfg = RunConfig.model_validate(TRAIN)
    with session_scope() as s:
        inst = TaskInstance(task_set="simulated", instance_id="sim-0", repo="simulated", record={})
        run = Run(kind="train", status="running", config=cfg.model_dump(mode="json"), started_at=_ago(60))
        s.add_all([inst, run])
        s.flush()
        run.summary = {"instance_ids": [inst.id]}
        for g, status in ((0, "accepted"), (1, "open")):
            s.add(Group(run_id=run.id, group_index=g, instance_id=inst.id, status=status))
            for k in range(2):
                s.add(Episode(run_id=run.id, instance_id=inst.id, group_index=g, sample_index=k, step=0,
                              status="completed" if status == "accepted" else "running", reward=float(k)))
        child = Run(kind="eval", status="running", config=heldout.eval_config(cfg, run.id, 1, TRAIN["eval_instances"],
                                                                              final=False))
        s.add(child)
        s.flush()
        for k, status in enumerate(("completed", "completed", "completed", "running")):
            s.add(Episode(run_id=child.id, instance_id=inst.id, group_index=k // 2, sample_index=k % 2, status=status))
        return run.id, child.id


def _step(run_id: int, **values) -> None:
    with session_scope() as s:
        row = s.query(TrainingStep).filter_by(run_id=run_id, step=values.pop("step", 0)).one()
        for key, value in values.items():
            setattr(row, key, value)


def test_follow_names_each_trainer_state_the_heldout_progress_and_each_trained_step(api, capsys, monkeypatch):
    run_id, eval_id = _seed()
    steps = []

    def advance(_seconds):
        """Between polls: the run moves to the trainer's next state, as the pipeline writes it."""
        steps.append(1)
        with session_scope() as s:
            run = s.get(Run, run_id)
            if len(steps) == 1:  # both groups accepted: the scheduler creates step 0, sent to the gpu queue
                s.query(Group).filter_by(run_id=run_id).update({"status": "trained", "step": 0})
                s.add(TrainingStep(run_id=run_id, step=0, status="pending", episode_ids=[], created_at=_ago(5)))
            elif len(steps) == 2:
                _step(run_id, status="training", started_at=_ago(37))
            elif len(steps) == 3:  # its checkpoint written: the engines load the new weights
                _step(run_id, checkpoint_path=f"var/runs/{run_id}/checkpoints/step_0")
            elif len(steps) == 4:
                _step(run_id, status="completed", policy_version=1, metrics=METRICS, finished_at=_ago(0))
                run.policy_version = 1
                run.summary = {**run.summary, "heldout_evals": {"1": eval_id}}
            elif len(steps) == 5:
                s.add(TrainingStep(run_id=run_id, step=1, status="completed", policy_version=2,
                                   metrics={**METRICS, "loss": 0.0123, "logprob_gap_max_abs": None}))
                run.status = "completed"

    monkeypatch.setattr(cli_client.time, "sleep", advance)
    assert main(["follow", str(run_id)]) == 0
    out = capsys.readouterr().out.splitlines()
    progress = [line for line in out if line.startswith(f"run {run_id} ")]
    trainer = [line.split("trainer: ", 1)[1].split(";")[0] for line in progress]
    # the seconds count from the row's created_at / started_at (seeded 5 and 37 s back)
    queued, training = (int(re.fullmatch(r".*\((\d+) s\)", trainer[i]).group(1)) for i in (1, 2))
    assert 5 <= queued < 37 <= training < 120
    assert trainer == ["step 0 waiting for its groups (1/2 ready)", f"step 0 on the gpu queue ({queued} s)",
                       f"step 0 training ({training} s)", "step 0 pushing weights",
                       "step 1 waiting for its groups (0/2 ready)", "all 2 steps trained"]
    assert f"held-out eval of step 1 (run {eval_id}) running, 3/4 episodes" in progress[4]
    assert "held-out" not in progress[0]
    trained = [line for line in out if line.startswith("step ")]
    assert trained == ["step 0 trained: reward 0.500, loss -0.0077, logprob gap max 2.10e-03 mean 3.10e-04, "
                       "12.5 s, policy version 1",
                       "step 1 trained: reward 0.500, loss 0.0123, logprob gap max - mean 3.10e-04, 12.5 s, "
                       "policy version 2"]
    assert out.index(trained[0]) < out.index(progress[4])  # the step's line comes before the next progress


@pytest.mark.parametrize("status, steps, expected", [
    ("queued", [], ("not_started", "the run has not started")),
    ("running", [("failed", "CUDA out of memory")], ("failed", "step 0 failed: CUDA out of memory")),
    ("cancelled", [("completed", None)], ("stopped", "stopped after 1 of 2 steps: the run is cancelled")),
])
def test_the_run_json_names_the_trainer_in_every_other_state(api, status, steps, expected):
    run_id, _eval_id = _seed()
    with session_scope() as s:
        s.get(Run, run_id).status = status
        for k, (st, error) in enumerate(steps):
            s.add(TrainingStep(run_id=run_id, step=k, status=st, error=error))
    body = api.test_client().get(f"/api/runs/{run_id}", headers=AUTH).get_json()
    assert (body["trainer"]["state"], body["trainer"]["text"]) == expected


def test_eval_runs_have_no_trainer(api):
    _run_id, eval_id = _seed()
    assert api.test_client().get(f"/api/runs/{eval_id}", headers=AUTH).get_json()["trainer"] is None


def test_on_a_terminal_the_live_table_shows_the_trainer_and_each_trained_step_is_printed_above_it(api, monkeypatch):
    import io

    from rich.console import Console

    run_id, _eval_id = _seed()
    with session_scope() as s:
        s.add(TrainingStep(run_id=run_id, step=0, status="completed", policy_version=1, metrics=METRICS))
        s.add(TrainingStep(run_id=run_id, step=1, status="training", started_at=_ago(3)))

    def finish(_seconds):
        with session_scope() as s:
            s.get(Run, run_id).status = "completed"
            _step(run_id, step=1, status="completed", policy_version=2, metrics=METRICS)

    monkeypatch.setattr(cli_client.time, "sleep", finish)
    screen = io.StringIO()
    final = cli_client.follow_run(run_id, console=Console(file=screen, force_terminal=True, width=200))
    assert final["trainer"]["text"] == "all 2 steps trained"
    shown = screen.getvalue()
    assert shown.count("step 0 trained: reward 0.500, loss -0.0077") == 1  # once, however often it is polled
    assert shown.count("step 1 trained: reward 0.500") == 1
    assert re.search(r"trainer\s*│\s*all 2 steps trained", shown), shown  # the live table's last frame
