"""Held-out evals during training (`eval_every`): real SQL, Redis and Celery workers, simulated stages.

A train run makes an eval run of its own at steps 0, N, 2N, ... and at the end; the trainer
never waits for one; a failed eval is shown on the run page and the run goes on; a split or
seed that does not exist is a 400 at creation.
"""
from __future__ import annotations

import pytest
from sqlalchemy import select

from app.control import heldout, scheduler
from app.db import session_scope
from app.paths import RunPaths
from app.runconfig import RunConfig
from app.tables import Episode, Run, TaskInstance, TrainingStep
from support import REDIS_BASE, api_client, celery_worker_args, wait_for

REDIS_DB = 10
TRAIN = {"kind": "train", "group_size": 2, "tasks_per_step": 1, "steps": 3, "eval_every": 2,
         "eval_instances": ["sim-h0", "sim-h1", "sim-h2"], "eval_samples": 2,
         "simulate": {"episode_median_s": 0.05, "train_s": 0.1, "reward_p": 0.5},
         "scheduling": {"rollout_slots": 4, "ready_depth": 0}}


@pytest.fixture
def var_dir(tmp_path, monkeypatch):
    from app import config

    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    config.reset_settings()
    yield tmp_path / "var"
    config.reset_settings()


def _tb_tags(run_id: int) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(RunPaths(run_id).tensorboard))
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("tensors", []):
        import tensorboard.util.tensor_util as tu

        out[tag] = [(e.step, float(tu.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    for tag in acc.Tags().get("scalars", []):
        out[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    return out


def test_a_train_run_evaluates_held_out_every_n_steps_and_at_the_end_without_waiting(database, redis_db, var_dir,
                                                                                         spawn):
    from app import create_app

    env = {"DATABASE_URL": database, "REDIS_URL": f"{REDIS_BASE}/{REDIS_DB}", "TURNSTILE_VAR_DIR": str(var_dir)}
    worker = spawn(celery_worker_args("control,prepare,rollout,grade,gpu", concurrency=3), env, name="cpu")
    client = api_client(create_app())
    resp = client.post("/api/runs", json=TRAIN)
    assert resp.status_code == 202, resp.get_json()
    train_id = resp.get_json()["id"]

    def done():
        body = client.get(f"/api/runs/{train_id}").get_json()
        points = body.get("heldout") or []
        if body["status"] == "completed" and points and all(p["status"] == "completed" for p in points):
            return body
        assert body["status"] not in ("failed", "cancelled"), body.get("error")
        return None

    body = wait_for(done, 120, what=f"train run and its held-out evals\n{worker.output()[-3000:]}")
    points = body["heldout"]
    assert [p["step"] for p in points] == [0, 2, 3]
    for p in points:
        assert p["instances"] == 3 and p["samples"] == 6, p
        assert 0 <= p["low"] <= p["pass_at_1"] <= p["high"] <= 1, p
        assert p["pass_at_1"] == pytest.approx(p["resolved"] / 6)  # 2 samples of each instance
    with session_scope() as s:
        evals = {p["step"]: s.get(Run, p["run_id"]) for p in points}
        assert all(r.kind == "eval" and r.config["eval_of"] == {"run": train_id, "step": v} for v, r in evals.items())
        assert evals[3].config["model"]["checkpoint"] == f"run:{train_id}"  # the last one: exactly the final weights
        assert evals[0].config["model"]["checkpoint"] is None  # mid-run: the engines as the train run keeps them
        assert evals[0].config["scheduling"]["rollout_slots"] == 2  # half the train run's slots
        assert evals[3].config["scheduling"]["rollout_slots"] == 4  # the last: the train run's, now free
        # the trainer did not wait: step 0 was trained before the step-0 eval finished
        step0 = s.scalar(select(TrainingStep).where(TrainingStep.run_id == train_id, TrainingStep.step == 0))
        assert step0.status == "completed"
    tags = _tb_tags(train_id)
    assert sorted(step for step, _ in tags["heldout/pass_at_1"]) == [0, 2, 3]  # written as each eval ends
    assert {step for step, _ in tags["heldout/pass_at_1_low"]} == {0, 2, 3}
    page = client.get(f"/runs/{train_id}")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert 'id="heldout"' in html and "chart-heldout" in html and "training reward" in html


def _seed_train_with_evals(s) -> tuple[Run, dict[str, Run]]:
    """A running train run at policy version 4 with eval_every 2 over 6 steps: the step-0 eval
    failed, the step-2 eval is running, the step-4 eval was made and never started, the step-6
    point is not due."""
    cfg = RunConfig.model_validate({**TRAIN, "steps": 6})
    inst = TaskInstance(task_set="simulated", instance_id="sim-0", repo="simulated", record={})
    train = Run(kind="train", config=cfg.model_dump(mode="json"), status="running", policy_version=4)
    s.add_all([inst, train])
    s.flush()
    children = {}
    for step, status, error in ((0, "failed", "starting the run: RuntimeError: engines did not answer"),
                                (2, "running", None), (4, "queued", None)):
        child = Run(kind="eval", status=status, error=error,
                    config=heldout.eval_config(cfg, train.id, step, ["sim-h0", "sim-h1"], final=False))
        s.add(child)
        s.flush()
        children[str(step)] = child
    train.summary = {"instance_ids": [inst.id], "heldout_evals": {k: c.id for k, c in children.items()}}
    return train, children


def test_the_curve_shows_every_state_and_a_failed_eval_leaves_the_train_run_going(database, redis_db, var_dir):
    from app import create_app

    with session_scope() as s:
        train, children = _seed_train_with_evals(s)
        train_id = train.id
        # the running eval has a graded sample already: its figures still wait for it to complete
        s.add(Episode(run_id=children["2"].id, instance_id=train.summary["instance_ids"][0], group_index=0,
                      sample_index=0, status="completed", reward=1.0, resolved=True))
    with session_scope() as s:
        points = heldout.curve(s, s.get(Run, train_id))
    by_step = {p["step"]: p for p in points}
    assert [p["step"] for p in points] == [0, 2, 4, 6]
    assert by_step[0]["status"] == "failed" and "engines did not answer" in by_step[0]["error"]
    assert by_step[2]["status"] == "running" and by_step[2]["pass_at_1"] is None
    assert by_step[4]["status"] == "queued" and by_step[4]["run_id"] is not None
    assert by_step[6] == {**by_step[6], "status": "pending", "run_id": None}

    plan = scheduler.tick(train_id)  # the failed eval does not stop the train run: it plans its groups
    with session_scope() as s:
        run = s.get(Run, train_id)
        assert run.status == "running" and run.error is None
        assert s.scalar(select(Episode.id).where(Episode.run_id == train_id)) is not None
        assert set(run.summary["heldout_evals"]) == {"0", "2", "4"}  # nothing is made twice
    assert plan.start == []

    client = api_client(create_app())
    body = client.get(f"/api/runs/{train_id}").get_json()
    assert [p["status"] for p in body["heldout"]] == ["failed", "running", "queued", "pending"]
    html = client.get(f"/runs/{train_id}").get_data(as_text=True)
    assert "engines did not answer" in html and html.count("not started") == 2
    child_html = client.get(f"/runs/{children['2'].id}").get_data(as_text=True)
    assert "held-out eval of" in child_html and f"/runs/{train_id}" in child_html


def test_evals_are_made_once_each_as_the_policy_reaches_them(database, redis_db, var_dir):
    cfg = RunConfig.model_validate({**TRAIN, "steps": 5})
    assert heldout.schedule(cfg) == [0, 2, 4, 5]
    assert heldout.schedule(cfg.model_copy(update={"eval_first": False})) == [2, 4, 5]
    with session_scope() as s:
        inst = TaskInstance(task_set="simulated", instance_id="sim-0", repo="simulated", record={})
        run = Run(kind="train", config=cfg.model_dump(mode="json"), status="running", policy_version=2)
        s.add_all([inst, run])
        s.flush()
        run.summary = {"instance_ids": [inst.id]}
        first = heldout.plan_evals(s, run, cfg, finished=False)
        assert len(first) == 2 and set(run.summary["heldout_evals"]) == {"0", "2"}
        assert heldout.plan_evals(s, run, cfg, finished=False) == []
        child = s.get(Run, first[1])
        assert child.status == "queued" and child.config["instances"] == ["sim-h0", "sim-h1", "sim-h2"]
        assert child.config["group_size"] == 2 and child.priority == run.priority


@pytest.mark.parametrize("spec, words", [
    ("family:heldout@9", "has split seeds 0, 1, not '9'"),
    ("family:validation", "has splits heldout, out_of_family, train, not 'validation'"),
    ("starter:heldout", "is a split of task set 'starter', but the run's task_set is 'family'"),
    ("heldout", "is not a split spec"),
])
def test_a_split_or_seed_that_does_not_exist_is_a_400_at_creation(database, redis_db, spec, words):
    from app import create_app

    client = api_client(create_app())
    resp = client.post("/api/runs", json={**TRAIN, "task_set": "family", "eval_instances": spec})
    assert resp.status_code == 400, resp.get_json()
    body = resp.get_json()["error"]
    found = [d for d in body["details"] if d["field"] == "eval_instances"]
    assert found and words in found[0]["message"], body
    with session_scope() as s:
        assert s.scalar(select(Run.id)) is None  # nothing was created


def test_eval_every_needs_instances_and_a_train_run(database, redis_db):
    from app import create_app

    client = api_client(create_app())
    resp = client.post("/api/runs", json={k: v for k, v in TRAIN.items() if k != "eval_instances"})
    assert resp.status_code == 400 and "eval_instances" in resp.get_json()["error"]["message"]
    resp = client.post("/api/runs", json={**TRAIN, "kind": "eval"})
    assert resp.status_code == 400 and "only a train run evaluates" in str(resp.get_json()["error"]["details"])


def test_the_last_eval_of_a_lora_run_samples_its_adapter_and_loads_no_checkpoint():
    """Loading a LoRA run's merged checkpoint would replace the base every LoRA run on the engines
    shares; its newest adapter is its final policy, and the gateway serves it to the eval."""
    full = RunConfig.model_validate({k: v for k, v in TRAIN.items() if k != "simulate"})
    lora = RunConfig.model_validate({**{k: v for k, v in TRAIN.items() if k != "simulate"},
                                     "training": {"lora": True}})
    assert heldout.eval_config(full, 7, 3, ["sim-h0"], final=True)["model"]["checkpoint"] == "run:7"
    assert heldout.eval_config(lora, 7, 3, ["sim-h0"], final=True)["model"]["checkpoint"] is None
    assert heldout.eval_config(full, 7, 2, ["sim-h0"], final=False)["model"]["checkpoint"] is None
