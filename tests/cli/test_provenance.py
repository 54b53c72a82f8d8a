"""No setting replaced in silence: `submit`/`demo` with a warm start against the real API (over WSGI),
a real database and Redis; where each setting came from is stored with the run."""
from __future__ import annotations

import json

import pytest

from app import config as settings
from app.cli import main
from app.db import session_scope
from app.paths import RunPaths
from app.tables import Run
from support import ROOT

REDIS_DB = 10
DEMO = str(ROOT / "demo" / "train.json")


@pytest.fixture
def var_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    settings.reset_settings()
    yield tmp_path / "var"
    settings.reset_settings()


@pytest.fixture
def api(var_dir, api):
    """The CLI's in-process API (tests/cli/conftest.py), over this test's own var folder."""
    return api


@pytest.fixture
def warm_starts(monkeypatch, tmp_path):
    """The warm start is a CPU fine-tune of minutes: replaced by a recorder that hands back an
    (empty) model folder, so a test sees whether, and when, it was asked for."""
    from app.training import warmstart

    calls: list[dict] = []
    folder = tmp_path / "warmstart-folder"
    folder.mkdir()

    def fake(config, section, default_instances):
        calls.append({"config": json.loads(json.dumps(config)), "section": dict(section)})
        return folder

    monkeypatch.setattr(warmstart, "warm_start_folder", fake)
    return calls


def _trained_run() -> int:
    """A completed train run with a checkpoint folder (what `run:<id>` resolves to)."""
    with session_scope() as s:
        run = Run(kind="train", status="completed", config={"kind": "train", "task_set": "starter"})
        s.add(run)
        s.flush()
        run_id = run.id
    (RunPaths(run_id).checkpoints / "step_1" / "model").mkdir(parents=True)
    return run_id


def _only_run() -> Run:
    with session_scope() as s:
        runs = s.query(Run).filter(Run.kind != "train").all()
        assert len(runs) == 1
        s.expunge(runs[0])
        return runs[0]


def test_set_checkpoint_wins_over_the_files_warm_start(api, warm_starts, capsys):
    """`--set kind=eval --set model.checkpoint=run:N` on the demo config evaluates run N's weights,
    not the warm start's: the warm start is skipped and says so."""
    trained = _trained_run()
    code = main(["submit", "--config", DEMO, "--set", "kind=eval", "--set", f"model.checkpoint=run:{trained}"])
    assert code == 0
    assert warm_starts == []
    assert "warm start skipped" in capsys.readouterr().err
    run = _only_run()
    assert run.config["model"]["checkpoint"] == f"run:{trained}"
    assert run.provenance["model.checkpoint"] == "--set"
    assert run.provenance["kind"] == "--set"
    assert run.provenance["harness"] == "file" and run.provenance["training.lora"] == "file"
    assert run.provenance["scheduling.share"] == "default"
    assert not any(path.startswith("warm_start") for path in run.provenance)


def test_warm_start_checkpoint_is_recorded_as_the_warm_starts(api, warm_starts):
    assert main(["submit", "--config", DEMO, "--set", "kind=eval"]) == 0
    assert len(warm_starts) == 1
    run = _only_run()
    assert run.config["model"]["checkpoint"].endswith("warmstart-folder")
    assert run.provenance["model.checkpoint"] == "warm start"


def test_checkpoint_and_warm_start_from_the_same_source_are_refused(api, warm_starts, tmp_path, capsys):
    trained = _trained_run()
    both = json.loads(open(DEMO).read())
    both["kind"] = "eval"
    both["model"]["checkpoint"] = f"run:{trained}"
    path = tmp_path / "both.json"
    path.write_text(json.dumps(both))
    assert main(["submit", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.checkpoint (from file)" in err and "warm_start section (from file)" in err
    assert warm_starts == []
    with session_scope() as s:
        assert s.query(Run).filter(Run.kind == "eval").count() == 0


def test_typos_are_all_reported_before_the_warm_start(api, warm_starts, capsys):
    code = main(["submit", "--config", DEMO, "--set", "harness=mini-swe-agnt", "--set", "task_set=startr",
                 "--set", "warm_start.epochz=2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "harness: unknown harness 'mini-swe-agnt'; did you mean 'mini-swe-agent'?" in err
    assert "task_set:" in err and "did you mean 'starter'?" in err
    assert "warm_start: warm_start: unknown setting(s) ['epochz']" in err
    assert warm_starts == []
    with session_scope() as s:
        assert s.query(Run).count() == 0


def test_an_unknown_instance_gets_the_closest_name(api, warm_starts, capsys):
    code = main(["submit", "--config", DEMO, "--set", "instances=starter__listkit-9,starter__tempkit-1",
                 "--set", 'warm_start.instances=["starter__listkit-1", "starter__tmpkit-1"]'])
    assert code == 2
    err = capsys.readouterr().err
    assert "instances: task set 'starter' has no instance(s) ['starter__listkit-9']" in err
    assert "warm_start.instances: task set 'starter' has no instance 'starter__tmpkit-1'; did you mean " \
           "'starter__tempkit-1'?" in err
    assert warm_starts == []


def test_demo_path_checks_before_the_warm_start(api, warm_starts, tmp_path, capsys):
    bad = json.loads(open(DEMO).read())
    bad["harness"] = "codx"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert main(["demo", "--config", str(path)]) == 2
    assert "did you mean 'codex'?" in capsys.readouterr().err
    assert warm_starts == []


def _learn_file(tmp_path, **changes) -> str:
    config = json.loads((ROOT / "demo" / "learn.json").read_text())
    config.update(changes)
    path = tmp_path / "learn.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_learn_refuses_what_its_recipe_would_replace_before_the_warm_start(api, warm_starts, tmp_path, capsys):
    trained = _trained_run()
    path = _learn_file(tmp_path, eval_instances=["family__x-1"], instances=["family__y-1"],
                       model={"name": "smollm2", "checkpoint": f"run:{trained}"}, harness="mini-swe-agnt")
    assert main(["learn", "--config", path]) == 2
    out = capsys.readouterr().out
    assert "eval_instances: learn evaluates learn.heldout" in out and "instances: learn trains on learn.train" in out
    assert "model.checkpoint: it and learn.warm_start both choose" in out
    assert "did you mean 'mini-swe-agent'?" in out
    assert warm_starts == []
    with session_scope() as s:
        assert s.query(Run).filter(Run.kind != "train").count() == 0


def test_learn_keeps_a_file_value_equal_to_its_own():
    """demo/learn.json names the same held-out split in eval_instances as in learn.heldout: nothing is
    replaced, so nothing is refused (the run's check then passes too)."""
    from app.cli.learning import replaced_settings, _ids

    config = json.loads((ROOT / "demo" / "learn.json").read_text())
    learn = config.pop("learn")
    assert replaced_settings(config, learn, None, _ids(learn["train"]), _ids(learn["heldout"])) == []
    assert replaced_settings({**config, "eval_samples": 9}, learn, None, _ids(learn["train"]),
                             _ids(learn["heldout"])) == ["eval_samples: learn takes learn.eval_samples; set it there"]
