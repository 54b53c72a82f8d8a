"""Train runs sharing a deployment: LoRA runs of one shape share it, a full fine-tune takes it alone,
and `POST /api/runs` refuses the rest with a 400 naming the field."""
from __future__ import annotations

import pytest

from app import create_app
from app.control.tenancy import engine_notice, engine_problems
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Run
from support import api_client


def holding(status: str = "running", **training) -> int:
    """A real train run row in `status` on the default engines; its id."""
    cfg = RunConfig.model_validate({"kind": "train", "training": training})
    with session_scope() as s:
        run = Run(kind="train", config=cfg.model_dump(mode="json"), status=status)
        s.add(run)
        s.flush()
        return run.id


def train(**training) -> RunConfig:
    return RunConfig.model_validate({"kind": "train", "training": training})


def fields(problems) -> list[str]:
    return [f for f, _m in problems]


def test_lora_runs_of_one_shape_share_and_other_shapes_are_refused_naming_the_field(database):
    first = holding(lora=True, lora_r=16)
    assert engine_problems(train(lora=True, learning_rate=1e-4, seed=3)) == []
    problems = engine_problems(train(lora=True, lora_r=8, lora_target_modules=["q_proj", "v_proj"]))
    assert fields(problems) == ["training.lora_r", "training.lora_target_modules"]
    assert f"train run {first}" in problems[0][1] and "16" in problems[0][1]
    assert fields(engine_problems(RunConfig.model_validate(
        {"kind": "train", "model": {"name": "tiny"}, "training": {"lora": True}}))) == ["model.name"]
    vllm = RunConfig.model_validate({"kind": "train", "model": {"engine": "vllm", "engine_urls": ["http://x"]},
                                     "training": {"lora": True}})
    assert engine_problems(vllm) == []  # other engines: no one in the way
    holding(lora=True, lora_r=16)
    with session_scope() as s:
        s.get(Run, first).config = {**s.get(Run, first).config, "model": {"engine": "vllm", "engine_urls": ["http://x"],
                                                                          "name": "smollm2"}}
    # vLLM engines serve each run's adapter per request too (--enable-lora): LoRA runs share them
    assert engine_problems(vllm) == []
    assert fields(engine_problems(RunConfig.model_validate(
        {"kind": "train", "model": {"engine": "vllm", "engine_urls": ["http://x"]},
         "training": {"lora": True, "lora_r": 8}}))) == ["training.lora_r"]
    with session_scope() as s:  # the same URLs named as another engine kind cannot share one pool
        s.get(Run, first).config = {**s.get(Run, first).config, "model": {"engine": "embedded",
                                                                          "engine_urls": ["http://x"], "name": "smollm2"}}
    problems = engine_problems(vllm)
    assert fields(problems) == ["model.engine"] and "'embedded' engines" in problems[0][1]


def test_a_full_fine_tune_and_lora_runs_do_not_share_engines(database):
    lora_run = holding(lora=True)
    problems = engine_problems(train())
    assert fields(problems) == ["training.lora"] and "full fine-tune" in problems[0][1] and str(lora_run) in problems[0][1]
    with session_scope() as s:
        s.get(Run, lora_run).status = "completed"
    full = holding("queued")
    problems = engine_problems(train(lora=True))
    assert fields(problems) == ["training.lora"] and f"train run {full} is a full fine-tune" in problems[0][1]
    # full fine-tunes side by side: allowed as before, and said
    assert engine_problems(train()) == []
    notice = engine_notice(train())
    assert notice["engines_held_by_runs"] == [full] and "replace the other's" in notice["message"]
    assert engine_notice(train(), exclude_run=full) is None and engine_notice(train(lora=True)) is None
    # other engines, simulated runs and eval runs are not in the way
    assert engine_problems(RunConfig.model_validate(
        {"kind": "train", "model": {"engine_urls": ["http://other:8000"]}, "training": {"lora": True}})) == []
    assert engine_problems(RunConfig.model_validate({"kind": "eval"})) == []
    assert engine_problems(RunConfig.model_validate({"kind": "train", "simulate": {}})) == []


@pytest.fixture
def client(database, redis_db):
    return api_client(create_app({"TESTING": True}))


def test_the_api_answers_400_naming_the_field(client):
    holding(lora=True, lora_r=16)
    with session_scope() as s:
        before = s.query(Run).count()
    resp = client.post("/api/runs", json={"kind": "train", "training": {"lora": True, "lora_alpha": 64}})
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err["field"] == "training.lora_alpha" and "LoRA pool" in err["message"], err
    resp = client.post("/api/runs", json={"kind": "train", "training": {"lora": False}})
    assert resp.status_code == 400 and resp.get_json()["error"]["field"] == "training.lora"
    with session_scope() as s:
        assert s.query(Run).count() == before  # nothing written


def test_lora_runs_do_not_share_engines_that_get_checkpoints_over_http(database, monkeypatch):
    from app import config

    holding(lora=True)
    assert engine_problems(train(lora=True)) == []
    monkeypatch.setenv("TURNSTILE_WEIGHT_TRANSFER", "push")
    config.reset_settings()
    try:
        assert fields(engine_problems(train(lora=True))) == ["model.engine_urls"]
    finally:
        monkeypatch.delenv("TURNSTILE_WEIGHT_TRANSFER")
        config.reset_settings()


def test_the_api_creates_a_full_fine_tune_next_to_another_and_says_so(client):
    other = holding()
    resp = client.post("/api/runs", json={"kind": "train"})
    assert resp.status_code == 202, resp.get_json()
    notice = resp.get_json()["engines_notice"]
    assert notice["engines_held_by_runs"] == [other] and "full fine-tune" in notice["message"]


def test_an_eval_that_loads_a_checkpoint_and_lora_runs_do_not_share_engines(database):
    """An eval run with `model.checkpoint` pushes full weights into its engines, as a full fine-tune
    does: it would replace the base the LoRA adapters sit on."""
    with_checkpoint = RunConfig.model_validate({"kind": "eval", "model": {"checkpoint": "run:1"}})
    assert engine_problems(with_checkpoint) == []  # no LoRA run in the way
    lora_run = holding(lora=True)
    problems = engine_problems(with_checkpoint)
    assert fields(problems) == ["model.checkpoint"] and str(lora_run) in problems[0][1]
    assert engine_problems(RunConfig.model_validate({"kind": "eval"})) == []  # samples the engines as they are
    assert engine_problems(RunConfig.model_validate(
        {"kind": "eval", "model": {"checkpoint": "run:1", "engine_urls": ["http://other:8000"]}})) == []
    with session_scope() as s:
        s.get(Run, lora_run).status = "completed"
        ev = Run(kind="eval", config=with_checkpoint.model_dump(mode="json"), status="running")
        s.add(ev)
        s.flush()
        eval_id = ev.id
    problems = engine_problems(train(lora=True))
    assert fields(problems) == ["training.lora"] and f"eval run {eval_id}" in problems[0][1]
    assert engine_problems(train()) == []  # a full fine-tune next to it: as before


def test_the_api_refuses_a_checkpoint_eval_while_lora_runs_share_the_engines(client, tmp_path):
    from app.engines.modeling import build_tiny_model, save_weights

    folder = save_weights(build_tiny_model(seed=0), tmp_path / "checkpoint")  # a real one: the API checks it
    lora_run = holding(lora=True)
    resp = client.post("/api/runs", json={"kind": "eval", "model": {"name": "tiny", "checkpoint": str(folder)}})
    assert resp.status_code == 400, resp.get_json()
    err = resp.get_json()["error"]
    assert err["field"] == "model.checkpoint" and f"LoRA train run(s) {lora_run}" in err["message"], err
