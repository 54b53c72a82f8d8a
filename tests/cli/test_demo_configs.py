"""The run configs `make demo` and `make learn` submit are valid before any process starts:
a typo in them would otherwise surface as a 400 after minutes of setup and a warm start."""
from __future__ import annotations


from app.config import ROOT

import pytest

from app.tasksets.starter import instance_ids as _ids
from app.cli.client import read_config_file
from app.runconfig import RunConfig
from app.tasksets import load_task_set
from app.training.warmstart import WarmStartConfig

DEMO = ROOT / "demo"


@pytest.mark.parametrize("name", ["train.json", "learn.json", "learn-starter.json"])
def test_demo_config_is_a_valid_train_run_on_instances_of_its_task_set(name):
    config = read_config_file(str(DEMO / name))
    learn = config.pop("learn", None) or {}
    warm = config.pop("warm_start", None) or learn.get("warm_start")
    cfg = RunConfig.model_validate(config)
    assert cfg.kind == "train" and cfg.task_set in ("starter", "family")
    known = {r.instance_id for r in load_task_set(cfg.task_set).instances}
    train = _ids(learn["train"]) if learn else list(cfg.instances)
    assert train and set(train) <= known
    heldout_spec = learn.get("heldout", f"{cfg.task_set}:heldout")
    if learn:
        heldout = _ids(heldout_spec)
        assert heldout and set(heldout) <= known and not set(heldout) & set(train)
        for seed in ("0", "1") if cfg.task_set == "family" else ():
            assert not set(_ids(f"{learn['train']}@{seed}")) & set(_ids(f"{heldout_spec}@{seed}"))
    assert warm is not None
    warm = dict(warm)
    demonstrated = _ids(warm.pop("instances", train))
    assert not set(demonstrated) & set(_ids(heldout_spec))  # held-out fixes are never demonstrated
    WarmStartConfig.from_dict(warm)  # raises on an unknown or mistyped key


def test_make_learn_evaluates_held_out_during_training_and_demonstrates_reading_the_file():
    from app.cli.learning import warm_section

    config = read_config_file(str(DEMO / "learn.json"))
    learn = config["learn"]
    assert config["eval_every"] and learn["out_of_family"] and learn["warm_start"]["read_file"] is True
    section = warm_section(learn, learn["warm_start"], _ids(learn["train"]))
    records = {r.instance_id: r for r in load_task_set("family").instances}
    kinds = {records[i].difficulty for i in section["instances"]}
    assert len(section["instances"]) == learn["warm_start_count"] and kinds == {"family-fix", "family-line"}
    assert set(section["instances"]) <= set(_ids("family:train"))


def test_make_demo_and_the_starter_learn_recipe_share_one_warm_start():
    """Same base, harness, instances and hyperparameters: the second command reuses the first's folder."""
    demo = read_config_file(str(DEMO / "train.json"))["warm_start"]
    learn = read_config_file(str(DEMO / "learn-starter.json"))["learn"]["warm_start"]
    assert demo == learn
