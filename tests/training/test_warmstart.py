"""The supervised warm start: fix commands from gold patches, demonstrations on the harness's own
prompt, LoRA fine-tuning into a cached model folder, and a train run that starts from it.

Real parts: the starter task set, the installed mini-swe-agent's own templates, real `sed` and
`bash`, the tiny model with SmolLM2's tokenizer, the real trainer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from app.config import ROOT

import pytest
import torch

from app.engines.modeling import build_tiny_model, load_model, load_tokenizer, save_weights
from app.engines.embedded.templates import render_prompt
from app.harnesses import get_preset
from app.tasksets import load_task_set
from app.training import steps
from app.training.warmstart import WarmStartConfig, demonstration, fix_command, warm_start


@pytest.fixture
def project_tools(monkeypatch):
    """The project's installed harnesses, also under a per-test var dir (requested before `var_dir`)."""
    monkeypatch.setenv("TURNSTILE_TOOLS_DIR", os.environ.get("TURNSTILE_TOOLS_DIR", str(ROOT / "var" / "tools")))


def materialize(record, root: Path) -> None:
    """The instance's buggy tree: the package's files with its `bug_patch` applied."""
    for rel, body in record.source.files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(body)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "apply", "-"], input=record.bug_patch, text=True, cwd=root, check=True)


@pytest.mark.parametrize("record", load_task_set("starter").instances, ids=lambda r: r.instance_id)
def test_fix_command_run_by_bash_applies_the_gold_patch(record, tmp_path):
    materialize(record, tmp_path / "cmd")
    materialize(record, tmp_path / "gold")
    subprocess.run(["bash", "-c", fix_command(record.patch)], cwd=tmp_path / "cmd", check=True)
    subprocess.run(["git", "apply", "-"], input=record.patch, text=True, cwd=tmp_path / "gold", check=True)
    for rel in record.source.files:
        assert (tmp_path / "cmd" / rel).read_text() == (tmp_path / "gold" / rel).read_text(), rel


def test_fix_command_escapes_every_sed_special_character(tmp_path):
    old, new = r"x = a[0].b * 2 ^ $y / 3 \ 'q' & z", r"x = a[1] / 2 & 'r' \ w"
    (tmp_path / "m.py").write_text(f"head\n{old}\ntail\n")
    patch = ("--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n head\n"
             f"-{old}\n+{new}\n tail\n")
    subprocess.run(["bash", "-c", fix_command(patch)], cwd=tmp_path, check=True)
    assert (tmp_path / "m.py").read_text() == f"head\n{new}\ntail\n"


def test_fix_command_refuses_a_patch_that_is_not_one_line_replacements():
    patch = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,3 @@\n head\n+added\n tail\n"
    with pytest.raises(ValueError, match="one-line replacements only"):
        fix_command(patch)


def test_demonstration_trains_only_the_two_tool_calls_on_the_harness_prompt():
    harness, tokenizer = get_preset("mini-swe-agent"), load_tokenizer()
    record = load_task_set("starter").instances[0]
    command = fix_command(record.patch)
    ids, mask = demonstration(tokenizer, harness, record.problem_statement, command)
    assert len(ids) == len(mask)
    messages, tools = harness.first_messages(record.problem_statement)
    first = render_prompt(tokenizer, messages, tools)
    assert ids[:len(first)] == first and not any(mask[:len(first)])
    assert record.problem_statement in messages[1]["content"]
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained.count("<tool_call>") == 2 and trained.count("<|im_end|>") == 2
    assert command.replace("\\", "\\\\").replace('"', '\\"') in trained
    assert harness.submit_command in trained and "tool_response" not in trained


def test_warm_start_learns_the_demonstrations_and_is_reused(project_tools, var_dir, tmp_path):
    records = load_task_set("starter").instances[:2]
    harness = get_preset("mini-swe-agent")
    config = WarmStartConfig(epochs=3, learning_rate=3e-3, lora_r=4, lora_alpha=8)
    lines: list[str] = []
    folder = warm_start("tiny", harness, records, config, tmp_path / "models", progress=lines.append)
    losses = [float(line.split("mean loss ")[1].split(",")[0]) for line in lines]
    assert len(losses) == 3 and losses[-1] < losses[0]
    model, _ = load_model(str(folder))
    meta = (folder / "turnstile.json").read_text()
    assert '"policy_version": 0' in meta and records[0].instance_id in meta
    base = build_tiny_model(0).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[key], base[key])  # the adapters were merged in
    again: list[str] = []
    assert warm_start("tiny", harness, records, config, tmp_path / "models", progress=again.append) == folder
    assert again == [f"warm start: reusing {folder}"]
    other = warm_start("tiny", harness, records[:1], WarmStartConfig(epochs=1), tmp_path / "models", progress=again.append)
    assert other != folder


def test_a_train_run_with_a_checkpoint_trains_from_those_weights(var_dir, engine, data):
    start = build_tiny_model(0)
    with torch.no_grad():
        start.model.embed_tokens.weight.mul_(1.01)  # not an adapter target: LoRA leaves it as loaded
    folder = save_weights(start, var_dir / "start", metadata={"policy_version": 0})
    run_id = data.run([engine.url], training={"lora": True, "lora_r": 4, "lora_alpha": 8})
    from app.db import session_scope
    from app.tables import Run

    with session_scope() as s:
        run = s.get(Run, run_id)
        run.config = {**run.config, "model": {**run.config["model"], "checkpoint": str(folder)}}
    episode_ids = data.group(run_id, 0, [1.0, 0.0], seed=1)
    metrics = steps.train_step(run_id, 0, episode_ids)
    assert metrics["policy_version"] == 1
    assert [(v, engine.loaded) for _name, _folder, v in engine.adapters] == [(1, [])]  # the adapter, not full weights
    trained = {k.removeprefix("base_model.model."): v for k, v in steps._RESIDENT.trainer.model.state_dict().items()}
    assert torch.equal(trained["model.embed_tokens.weight"], start.model.embed_tokens.weight)
    assert not torch.equal(trained["model.embed_tokens.weight"], build_tiny_model(0).model.embed_tokens.weight)


def test_warm_start_section_of_a_config_names_its_instances_and_rejects_unknown_settings(project_tools, var_dir):
    from app.training.warmstart import warm_start_folder

    config = {"task_set": "starter", "harness": "mini-swe-agent", "model": {"name": "tiny"}}
    section = {"instances": ["starter__mathkit-1"], "epochs": 1, "lora_r": 2, "lora_alpha": 4}
    folder = warm_start_folder(config, section, "starter:train")
    assert folder.parent == (var_dir / "models").resolve()
    assert '"starter__mathkit-1"' in (folder / "turnstile.json").read_text()
    assert "starter__mathkit-2" not in (folder / "turnstile.json").read_text()
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['epoch'\]"):
        warm_start_folder(config, {"epoch": 2}, "starter:train")


def test_a_train_run_refuses_a_moving_run_checkpoint_and_accepts_a_folder(tmp_path):
    from pydantic import ValidationError

    from app.runconfig import RunConfig

    with pytest.raises(ValidationError, match="fixed checkpoint folder"):
        RunConfig(kind="train", model={"name": "tiny", "checkpoint": "run:3"})
    assert RunConfig(kind="train", model={"name": "tiny", "checkpoint": str(tmp_path)}).model.checkpoint == str(tmp_path)
    assert RunConfig(kind="eval", model={"name": "tiny", "checkpoint": "run:3"}).model.checkpoint == "run:3"


def test_the_cli_prints_only_the_model_folder_on_stdout(project_tools, tmp_path):
    """`ln -sfn "$(turnstile warm-start --config ...)" ...` (docs/distill.md) needs stdout to be the
    folder alone: the epoch lines go to stderr, from the spawned child that trains, and on reuse."""
    config = tmp_path / "learn.json"
    config.write_text(json.dumps({
        "kind": "train", "task_set": "starter", "harness": "mini-swe-agent", "model": {"name": "tiny"},
        "learn": {"train": [r.instance_id for r in load_task_set("starter").instances[:1]],
                  "warm_start": {"epochs": 2, "lora_r": 4, "lora_alpha": 8}}}))
    env = {**os.environ, "TURNSTILE_VAR_DIR": str(tmp_path / "var")}
    runs = [subprocess.run([sys.executable, "-m", "app", "warm-start", "--config", str(config)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    first, again = runs
    assert first.returncode == 0, first.stderr[-2000:]
    folder = Path(first.stdout.strip())
    assert first.stdout == f"{folder}\n" and (folder / "config.json").is_file()
    assert folder.parent == (tmp_path / "var" / "models").resolve()
    assert "warm start: epoch 2/2" in first.stderr
    assert again.returncode == 0 and again.stdout == first.stdout
    assert f"warm start: reusing {folder}" in again.stderr
