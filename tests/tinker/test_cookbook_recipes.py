"""tinker-cookbook's own recipes, unmodified, against a whole Turnstile stack on CPU (the Tinker
service, the gpu worker, a rollout worker, the embedded engine on SmolLM2-135M-Instruct).

Each recipe runs as its own process through its own command line; only its options are given:
`base_url`, the model name (SmolLM2's Hub id), a renderer, small batch sizes and a step limit.

* Supervised: `tinker_cookbook.recipes.chat_sl.train` on the conversations file the cookbook
  ships (`example_data/conversations.jsonl`), loss `cross_entropy`: its train NLL falls.
* RL: `tinker_cookbook.recipes.math_rl.train env=arithmetic` (problems it generates itself),
  loss `importance_sampling`: sample -> reward -> forward_backward -> optim_step, with the
  reward of every step recorded in the recipe's metrics.jsonl.

Why these two and not `sl_loop` / `rl_loop` (or `sl_basic` / `rl_basic`): those four ask
`model_info.get_recommended_renderer_name(model_name)` before reading any option, and it raises
for a model of an organisation outside the cookbook's lineup (SmolLM2 is HuggingFaceTB's), and
`sl_loop` / `rl_loop` load fixed Hub datasets (no_robots, gsm8k), which this machine cannot
reach.  chat_sl and math_rl take `renderer_name` and local data as options.

Offline tokenizer: the cookbook loads the tokenizer with `AutoTokenizer.from_pretrained(model_name)`,
which takes a local folder of that name before the Hub, so each recipe runs in a folder holding
`HuggingFaceTB/SmolLM2-135M-Instruct/` (a link to the tokenizer files the service uses).  With
the Hub reachable the name alone would do.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker_cookbook

from support.tinker_stack import start_stack

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
RECIPE_TIMEOUT_S = 600


@pytest.fixture
def stack(request, spawn, monkeypatch):
    return start_stack(request, spawn, monkeypatch, "smollm2")


def _recipe_dir(tmp_path: Path) -> Path:
    """A working folder in which `HUB_ID` names the tokenizer's files (module docstring)."""
    from app.engines import modeling

    modeling.load_tokenizer()  # writes the tokenizer folder on first use
    work = tmp_path / "recipe"
    (work / HUB_ID).parent.mkdir(parents=True)
    (work / HUB_ID).symlink_to(modeling.models_dir() / modeling.TOKENIZER_DIR, target_is_directory=True)
    return work


def _run_recipe(stack, key, tmp_path: Path, module: str, options: dict) -> list[dict]:
    """Run recipe `module` with `options` (its own chz command line) against the stack; return
    the rows of its metrics.jsonl.  Fails with the recipe's and the stack's output when it does."""
    work = _recipe_dir(tmp_path)
    log_path = tmp_path / "log"
    args = [f"{k}={v}" for k, v in {"base_url": stack.url, "model_name": HUB_ID, "log_path": log_path,
                                    "behavior_if_log_dir_exists": "delete", **options}.items()]
    env = {**os.environ, "TINKER_API_KEY": key("alice"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path / "runs")}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=RECIPE_TIMEOUT_S)
    assert proc.returncode == 0, f"{module} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}" \
                                 f"\n{stack.logs()}"
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _tinker_run() -> tuple[str, dict]:
    """(status, Tinker progress) of the one Tinker model's run the recipe made."""
    from sqlalchemy import select

    from app.control.tinker_progress import progress
    from app.db import session_scope
    from app.tables import Run

    with session_scope() as s:
        runs = s.scalars(select(Run).where(Run.kind == "tinker")).all()
        assert len(runs) == 1, [r.id for r in runs]
        return runs[0].status, progress(s, runs[0].id)


def test_chat_sl_recipe_loss_falls(stack, key, tmp_path):
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    rows = _run_recipe(stack, key, tmp_path, "tinker_cookbook.recipes.chat_sl.train", {
        "dataset": conversations, "renderer_name": "role_colon", "lora_rank": 8, "batch_size": 8,
        "learning_rate": 1e-3, "lr_schedule": "constant", "max_steps": 6, "max_length": 256,
        "save_every": 0, "eval_every": 0, "infrequent_eval_every": 0})
    steps = [row for row in rows if "train_mean_nll" in row]
    nll = [row["train_mean_nll"] for row in steps]
    assert len(nll) == 6, rows
    # SmolLM2 has never seen the role_colon format: the first batch costs most (2.4 nats/token
    # when measured), six batches on it costs well under half.
    assert sum(nll[-2:]) / 2 < 0.6 * nll[0], nll
    status, progress = _tinker_run()
    # The recipe closed its ServiceClient: the run ended.  Its page shows the same steps and losses
    # the recipe logged: the trainer's loss:sum over the step's loss tokens is its train NLL.
    assert (status, progress["steps"]) == ("completed", 6)
    per_step = [sum(p["value"] for p in progress["losses"] if p["step"] == i) for i in range(6)]
    for row, loss_sum in zip(steps, per_step, strict=True):
        assert loss_sum / row["num_loss_tokens"] == pytest.approx(row["train_mean_nll"], rel=1e-4)


def test_math_rl_recipe_records_reward_per_step(stack, key, tmp_path):
    rows = _run_recipe(stack, key, tmp_path, "tinker_cookbook.recipes.math_rl.train", {
        "env": "arithmetic", "renderer_name": "role_colon", "lora_rank": 8, "group_size": 4,
        "groups_per_batch": 2, "max_tokens": 12, "learning_rate": 1e-4, "loss_fn": "importance_sampling",
        "max_steps": 3, "eval_every": 0, "save_every": 0})
    steps = [row for row in rows if "env/all/reward/total" in row]
    assert [row["step"] for row in steps] == [0, 1, 2], rows
    for row in steps:
        # arithmetic's reward: format_coef (0.1) * (correct_format - 1) + correct_answer
        assert row["env/all/reward/total"] == pytest.approx(0.1 * (row["env/all/format"] - 1)
                                                           + row["env/all/correct"])
        assert row["env/all/total_episodes"] == 8  # 2 groups of 4, sampled through the service
    status, progress = _tinker_run()
    assert (status, progress["steps"]) == ("completed", 3)
    assert len(progress["sampler_checkpoints"]) >= 3  # a sampler for each step's rollouts
    assert progress["futures"].get("failed", 0) == 0, progress
