"""A train run and two eval runs written to SQL the way the pipeline writes them.

Completions carry SmolLM2 token ids from the model's own tokenizer over ChatML markup;
trajectories are built from them by the real prefix-merging builder (`build_episode_trajectories`),
so the token view and the cut reasons shown are the ones training would use.  Step metrics have
the keys the trainer and scheduler record.
"""
from __future__ import annotations

import datetime as dt
import math
import random

from app.config import get_settings
from app.db import session_scope
from app.tables import Completion, Episode, Group, Run, TaskInstance, TrainingStep
from app.runconfig import RunConfig
from app.training.store import build_episode_trajectories

T0 = dt.datetime(2026, 11, 30, 9, 0, tzinfo=dt.timezone.utc)
INSTANCES = ["synthetic__calc-add", "synthetic__strings-slug", "synthetic__dates-range"]
# As long as a real harness's system prompt (its rules take hundreds of tokens): the sampled tokens
# start far below the top of the token view.
SYSTEM = ("You are a helpful assistant that can interact with a computer shell to solve programming tasks.\n\n"
          + "".join(f"Rule {i}: reply with exactly one bash code block and a THOUGHT line explaining why; commands "
                    "run in a fresh subshell, so chain them with && and never rely on an earlier cd.\n"
                    for i in range(1, 41)))
PATCH = """diff --git a/calc.py b/calc.py
index 3b18e51..a1c2d3f 100644
--- a/calc.py
+++ b/calc.py
@@ -1,4 +1,4 @@
 def add(a, b):
-    return a - b
+    return a + b
 
 
"""
WRONG_PATCH = PATCH.replace("+    return a + b", "+    return b - a")


def _report(instance: str, resolved: bool) -> dict:
    """swebench's `get_eval_report` shape plus what our grader adds."""
    f2p = [f"tests/test_{instance.split('__')[1]}.py::test_fixed"]
    p2p = [f"tests/test_{instance.split('__')[1]}.py::test_existing_{i}" for i in range(2)]
    return {"patch_is_None": False, "patch_exists": True, "patch_successfully_applied": True, "resolved": resolved,
            "tests_status": {"FAIL_TO_PASS": {"success": f2p if resolved else [], "failure": [] if resolved else f2p},
                             "PASS_TO_PASS": {"success": p2p, "failure": []}},
            "apply": {"applied": True, "method": "git apply --verbose", "reason": None},
            "timings": {"prepare_s": 0.8, "apply_s": 0.05, "eval_s": 1.9, "total_s": 2.8}, "cached": False}


def _instance(s, name: str) -> TaskInstance:
    row = TaskInstance(task_set="synthetic", instance_id=name, repo="synthetic/" + name.split("__")[1],
                       base_commit="0" * 40, record={"instance_id": name, "problem_statement": f"Fix {name}."})
    s.add(row)
    s.flush()
    return row


def _chatml(messages: list[dict]) -> str:
    """SmolLM2's chat markup (ChatML) of `messages`, ending with the assistant's turn opening."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def _calls(tok, rng: random.Random, rewrite_last: bool) -> list[dict]:
    """Three chat calls of a shell agent: the second extends the first token for token; the third
    either extends it too or (`rewrite_last`) comes after the harness compacted its history."""
    im_end = tok.token_to_id("<|im_end|>")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Fix the bug in calc.py: add(2, 3) returns -1."}]
    answers = ["THOUGHT: Let me look at the file first.\n\n```bash\ncat calc.py\n```",
               "THOUGHT: add subtracts. I will fix it.\n\n```bash\nsed -i 's/a - b/a + b/' calc.py\n```",
               "THOUGHT: Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"]
    observations = ["def add(a, b):\n    return a - b\n", "(no output)"]
    prompt = tok.encode(_chatml(messages), add_special_tokens=False).ids
    calls = []
    for i, answer in enumerate(answers):
        sampled = tok.encode(answer, add_special_tokens=False).ids + [im_end]
        logprobs = [-abs(rng.gauss(0, 0.25)) - (rng.random() * 4 if rng.random() < 0.12 else 0) for _ in sampled]
        calls.append({"messages": [dict(m) for m in messages], "prompt_ids": list(prompt), "sampled_ids": sampled,
                      "logprobs": logprobs, "answer": answer})
        if i == len(observations):
            break
        observation = {"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{observations[i]}</output>"}
        if rewrite_last and i == 1:
            # compaction: the harness summarises the history, so the prompt no longer extends the chain
            messages = [messages[0], {"role": "user", "content": "Summary so far: calc.add was fixed. Verify and submit."}]
            prompt = tok.encode(_chatml(messages), add_special_tokens=False).ids
            continue
        messages = messages + [{"role": "assistant", "content": answer}, observation]
        glue = tok.encode(f"\n<|im_start|>user\n{observation['content']}<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False).ids
        prompt = list(prompt) + sampled + glue
    return calls


def _add_completions(s, episode: Episode, tok, rng: random.Random, rewrite_last: bool, start: dt.datetime) -> None:
    for seq, call in enumerate(_calls(tok, rng, rewrite_last)):
        s.add(Completion(
            episode_id=episode.id, seq=seq, request_key=f"k{episode.id}-{seq}", api="chat", model="smollm2",
            stream=seq % 2 == 1, raw_request={"messages": call["messages"]},
            normalized_request={"model": "smollm2", "messages": call["messages"]},
            response={"id": f"chatcmpl-{episode.id}-{seq}", "object": "chat.completion",
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": call["answer"]}}]},
            prompt_ids=call["prompt_ids"], sampled_ids=call["sampled_ids"], logprobs=call["logprobs"],
            finish_reason="stop", engine_id="http://127.0.0.1:8200", policy_version=episode.policy_version,
            queue_ms=3.0, first_token_ms=180.0 + seq, total_ms=2400.0 + 300 * seq,
            created_at=start + dt.timedelta(seconds=5 * seq)))
    s.flush()


def _step_metrics(step: int, rewards: list[float], rng: random.Random) -> dict:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(1, len(rewards) - 1))
    return {
        "episodes": len(rewards), "groups": 2, "reward_mean": mean, "reward_std": std, "resolved_rate": mean,
        "advantage_mean": 0.0, "advantage_std": 0.9, "loss": 0.02 - 0.006 * step + rng.random() * 0.004,
        "kl": 1e-4 * (step + 1), "clip_fraction": 0.01 * step, "logprob_gap_max_abs": 2e-3 + 1e-4 * step,
        "logprob_gap_mean_abs": 2e-4, "tokens_trained": 420 + 30 * step, "tokens_processed": 1600 + 100 * step,
        "builder": "prefix_merging",
        "merge": {"completions": 12, "completions_merged": 9 - step, "chains": 3 + step, "chains_cut": step,
                  "rejected": 0, "trainable_tokens": 180 + 20 * step, "cut_reasons": {"context_diverged": step} if step else {}, "rejected_reasons": {}},
        "scheduling": {"trainer_busy_fraction": 0.55 + 0.1 * step, "rollout_slot_occupancy": 0.9,
                       "ready_wait_s": {"n": 4, "p50": 0.04 + 0.01 * step, "max": 0.3},
                       "gpu_queue_wait_s": 0.5 + step, "staleness_hist": {"0": 3, "1": step}},
        "policy_version": step + 1, "step_time_s": 11.5, "update_time_s": 8.1 + step, "checkpoint_time_s": 1.2,
        "engine_sync_time_s": 0.4, "grad_norm": 0.8 - 0.1 * step, "optimizer_updates": 1,
        "tis_weight_mean": 0.98, "tis_truncated_fraction": 0.02 * step, "ratio_mean": 1.0,
        "advantage_min": -1.2, "advantage_max": 1.3, "zero_advantage_group_fraction": 0.5 if step == 1 else 0.0,
    }


def seed() -> dict:
    """Write the runs; returns their ids and the ids of notable episodes."""
    from app.api.tokenizer import smollm2_tokenizer

    tok = smollm2_tokenizer()
    rng = random.Random(7)
    ids: dict = {}
    with session_scope() as s:
        inst = [_instance(s, name) for name in INSTANCES]
        # the train run and the two evals below are one `turnstile learn` series: before, train, after
        cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
                                        "group_size": 2, "tasks_per_step": 2, "steps": 3,
                                        "training": {"kl_coef": 0.001},
                                        "series": {"id": LEARN_SERIES, "role": "train"}}).model_dump(mode="json")
        train = Run(kind="train", status="completed", config=cfg, policy_version=3, created_at=T0,
                    started_at=T0, finished_at=T0 + dt.timedelta(minutes=9))
        s.add(train)
        s.flush()
        ids["train"] = train.id
        resolved_pattern = [[0, 0, 1, 0], [1, 0, 1, 1], [1, 1, 1, 0]]
        for step in range(3):
            episode_ids = []
            for g in range(2):
                s.add(Group(run_id=train.id, group_index=step * 2 + g, instance_id=inst[g].id, status="trained", step=step,
                            policy_version=step))
                for k in range(2):
                    n = g * 2 + k
                    ok = bool(resolved_pattern[step][n])
                    start = T0 + dt.timedelta(minutes=3 * step, seconds=20 * n)
                    ep = Episode(run_id=train.id, instance_id=inst[g].id, step=step, group_index=step * 2 + g,
                                 sample_index=k, status="completed", attempts=1, policy_version=step,
                                 patch=PATCH if ok else WRONG_PATCH, exit_status="submitted", reward=float(ok), resolved=ok,
                                 grading_report=_report(INSTANCES[g], ok), created_at=start - dt.timedelta(seconds=30),
                                 prepared_at=start - dt.timedelta(seconds=10), started_at=start,
                                 rollout_finished_at=start + dt.timedelta(seconds=40 + 7 * n),
                                 finished_at=start + dt.timedelta(seconds=45 + 7 * n))
                    if step == 2 and n == 3:
                        ep.status, ep.reward, ep.resolved, ep.grading_report = "failed", None, None, None
                        ep.error = "harness exited 1 before its first model call: ModuleNotFoundError: No module named 'yaml'"
                        ep.exit_status = "exit 1"
                    s.add(ep)
                    s.flush()
                    episode_ids.append(ep.id)
                    if ep.status == "completed":
                        _add_completions(s, ep, tok, rng, rewrite_last=(n == 1), start=start)
                        build_episode_trajectories(s, ep.id, "prefix_merging")
                    if step == 0 and n == 0:
                        ids["merged_episode"] = ep.id
                    if step == 0 and n == 1:
                        ids["cut_episode"] = ep.id
                    if step == 2 and n == 3:
                        ids["failed_episode"] = ep.id
            rewards = [float(r) for r in resolved_pattern[step][: 3 if step == 2 else 4]]
            s.add(TrainingStep(run_id=train.id, step=step, status="completed", policy_version=step + 1,
                               episode_ids=episode_ids, metrics=_step_metrics(step, rewards, rng),
                               checkpoint_path=f"var/runs/{train.id}/checkpoints/step_{step}",
                               started_at=T0 + dt.timedelta(minutes=3 * step + 2),
                               finished_at=T0 + dt.timedelta(minutes=3 * step + 2, seconds=12)))
        for label, pattern in (("eval_base", [[0, 0, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]),
                               ("eval_trained", [[1, 0, 1, 1], [0, 1, 0, 0], [1, 1, 0, 1]])):
            model = {"name": "smollm2", "checkpoint": None if label == "eval_base" else f"run:{train.id}"}
            role = "before" if label == "eval_base" else "after"
            cfg = RunConfig.model_validate({"kind": "eval", "harness": "mini-swe-agent", "task_set": "synthetic",
                                            "group_size": 4, "tasks_per_step": 3, "steps": 1, "model": model,
                                            "series": {"id": LEARN_SERIES, "role": role}}).model_dump(mode="json")
            run = Run(kind="eval", status="completed", config=cfg, priority=5, created_at=T0 + dt.timedelta(minutes=10),
                      started_at=T0 + dt.timedelta(minutes=10), finished_at=T0 + dt.timedelta(minutes=14))
            s.add(run)
            s.flush()
            ids[label] = run.id
            for g, row in enumerate(pattern):
                s.add(Group(run_id=run.id, group_index=g, instance_id=inst[g].id, status="done"))
                for k, ok in enumerate(row):
                    s.add(Episode(run_id=run.id, instance_id=inst[g].id, step=0, group_index=g, sample_index=k,
                                  status="completed", attempts=1, policy_version=0, reward=float(ok), resolved=bool(ok),
                                  patch=PATCH if ok else "", exit_status="submitted",
                                  grading_report=_report(INSTANCES[g], bool(ok)),
                                  started_at=run.started_at, rollout_finished_at=run.started_at + dt.timedelta(seconds=50),
                                  finished_at=run.started_at + dt.timedelta(seconds=55)))
        cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
                                        "group_size": 2, "tasks_per_step": 1, "steps": 2}).model_dump(mode="json")
        live = Run(kind="train", status="running", config=cfg, started_at=dt.datetime.now(dt.timezone.utc))
        s.add(live)
        s.flush()
        ids["running"] = live.id
        for k in range(2):
            s.add(Episode(run_id=live.id, instance_id=inst[0].id, step=0, group_index=0, sample_index=k,
                          status="running", attempts=1, policy_version=0, started_at=live.started_at))
        seed_states(s, inst, tok, rng, ids)
    _write_log(ids["train"], ids["merged_episode"])
    _seed_reload_holds()
    return ids


def _seed_reload_holds() -> None:
    """The gateway held three harness calls (4.5 s in all) while the engine loaded new weights,
    and holds one more now: the counters `app.weight_gate` keeps in Redis."""
    from app import weight_gate
    from app.redis_client import get_redis

    url = get_settings().engine_urls[0]
    for held_s in (1.0, 1.5, 2.0):
        weight_gate.record_hold(url, held_s)
    get_redis().hincrby(weight_gate.stats_key(url), "holding", 1)


def _episodes(s, run: Run, inst: TaskInstance, step: int, group: int, marks: str, start: dt.datetime) -> list[Episode]:
    """One group's episodes from `marks`, one letter a sample: 1/0 completed with that reward,
    F failed, C cancelled, q/p/r/R/g queued, preparing, ready, running, grading."""
    names = {"F": "failed", "C": "cancelled", "q": "queued", "p": "preparing", "r": "ready", "R": "running", "g": "grading"}
    out = []
    for k, mark in enumerate(marks):
        status = "completed" if mark in "01" else names[mark]
        ep = Episode(run_id=run.id, instance_id=inst.id, step=step, group_index=group, sample_index=k, status=status,
                     attempts=1, policy_version=step, created_at=start,
                     started_at=start if status not in ("queued", "preparing", "ready") else None)
        if status == "completed":
            ep.reward, ep.resolved, ep.exit_status = float(mark), mark == "1", "submitted"
            ep.patch = PATCH if mark == "1" else WRONG_PATCH
            ep.grading_report, ep.finished_at = _report(inst.instance_id, mark == "1"), start + dt.timedelta(seconds=50)
        elif status == "failed":
            ep.error, ep.exit_status, ep.timed_out = "harness timed out after 600 s and produced no patch", "timeout", True
        elif status == "cancelled":
            ep.error = "straggler cancelled: group had enough graded episodes"
        s.add(ep)
        out.append(ep)
    s.flush()
    return out


def seed_states(s, inst: list[TaskInstance], tok, rng: random.Random, ids: dict) -> None:
    """Runs in every state a page must render: a live train run whose groups were trained, set
    aside, dropped as stale or rejected, with a step training and episodes in every state; a run
    whose step is pending; a failed run with a failed step; queued, cancelling and cancelled runs."""
    now = dt.datetime.now(dt.timezone.utc)
    cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
                                    "group_size": 4, "tasks_per_step": 2, "steps": 4}).model_dump(mode="json")
    live = Run(kind="train", status="running", config=cfg, policy_version=2, created_at=now - dt.timedelta(minutes=30),
               started_at=now - dt.timedelta(minutes=30))
    s.add(live)
    s.flush()
    ids["live_train"] = live.id
    # (group, step, instance, marks, group status, reason, weight)
    plan = [(0, 0, 0, "1011", "trained", None, 1.0), (1, 0, 1, "0100", "trained", None, 1.0),
            (2, 0, 2, "1111", "filtered", "all 4 usable rewards are 1: no advantage (dynamic sampling)", 1.0),
            (3, 1, 0, "0011", "trained", None, 1.0), (4, 1, 1, "1000", "trained", None, 0.5),
            (5, 1, 2, "0110", "dropped", "stale: served by version 0, policy is 3", 1.0),
            (6, 1, 0, "1FFF", "rejected", "1/4 usable episodes", 1.0),
            (7, 2, 1, "1100", "trained", None, 1.0), (8, 2, 2, "0001", "trained", None, 1.0),
            (9, 3, 0, "qprR", "open", None, 1.0), (10, 3, 1, "g10C", "open", None, 1.0),
            (11, 3, 2, "0110", "accepted", None, 1.0)]
    members: dict[int, list[Episode]] = {}
    for group, step, i, marks, status, reason, weight in plan:
        start = live.started_at + dt.timedelta(minutes=4 * step, seconds=10 * group)
        members[group] = _episodes(s, live, inst[i], step, group, marks, start)
        s.add(Group(run_id=live.id, group_index=group, instance_id=inst[i].id, status=status, reason=reason,
                    weight=weight, step=step if status in ("trained", "filtered") else None, policy_version=step))
    filtered = members[2][0]
    _add_completions(s, filtered, tok, rng, rewrite_last=False, start=live.started_at)
    build_episode_trajectories(s, filtered.id, "prefix_merging")
    ids["filtered_episode"], ids["stale_episode"] = filtered.id, members[5][1].id
    ids["trained_live_episode"], ids["training_episode"] = members[0][0].id, members[7][0].id
    for step, groups in ((0, (0, 1)), (1, (3, 4)), (2, (7, 8))):
        eps = [e for g in groups for e in members[g] if e.status == "completed"]
        metrics = {"scheduling": {"trainer_busy_fraction": 0.6, "rollout_slot_occupancy": 0.8,
                                  "ready_wait_s": {"n": 2, "p50": 0.05, "max": 0.2}, "staleness_hist": {"0": 2}}}
        if step < 2:  # a completed step: the trainer's metrics (kl_coef is 0: `kl` is the trainer's 0.0)
            metrics = {**_step_metrics(step, [e.reward for e in eps], rng), "kl": 0.0}
        if step == 1:  # every sequence over the length limit: no update, and the trainer writes loss 0.0
            metrics.update(optimizer_updates=0, loss=0.0, grad_norm=0.0, clip_fraction=0.0)
        s.add(TrainingStep(run_id=live.id, step=step, status="completed" if step < 2 else "training",
                           policy_version=step + 1 if step < 2 else None, episode_ids=[e.id for e in eps],
                           metrics=metrics, started_at=start, finished_at=start if step < 2 else None))
    _other_states(s, inst, now, ids)


def _other_states(s, inst: list[TaskInstance], now: dt.datetime, ids: dict) -> None:
    def run(label: str, kind: str, status: str, error: str | None = None, steps: int = 2) -> Run:
        cfg = RunConfig.model_validate({"kind": kind, "harness": "mini-swe-agent", "task_set": "synthetic",
                                        "group_size": 2, "tasks_per_step": 1, "steps": steps}).model_dump(mode="json")
        r = Run(kind=kind, status=status, config=cfg, error=error, created_at=now - dt.timedelta(minutes=20),
                started_at=None if status == "queued" else now - dt.timedelta(minutes=19),
                finished_at=now - dt.timedelta(minutes=2) if status in ("failed", "cancelled") else None)
        s.add(r)
        s.flush()
        ids[label] = r.id
        return r

    pending = run("pending_train", "train", "running")
    eps = _episodes(s, pending, inst[0], 0, 0, "10", now - dt.timedelta(minutes=5))
    s.add(Group(run_id=pending.id, group_index=0, instance_id=inst[0].id, status="trained", step=0))
    # what the scheduler writes when it creates a step: only its own metrics, until the trainer runs it
    s.add(TrainingStep(run_id=pending.id, step=0, status="pending", episode_ids=[e.id for e in eps],
                       metrics={"scheduling": {"trainer_busy_fraction": 0.0, "staleness_hist": {"0": 1}}}))
    failed = run("failed_train", "train", "failed", error="step 1 failed: CUDA out of memory (tried to allocate 2.1 GiB)")
    for step in range(2):
        eps = _episodes(s, failed, inst[step], step, step, "10", now - dt.timedelta(minutes=15 - 5 * step))
        s.add(Group(run_id=failed.id, group_index=step, instance_id=inst[step].id, status="trained", step=step))
        s.add(TrainingStep(run_id=failed.id, step=step, status="completed" if step == 0 else "failed",
                           policy_version=1 if step == 0 else None, episode_ids=[e.id for e in eps],
                           metrics=_step_metrics(0, [1.0, 0.0], random.Random(1)) if step == 0 else None,
                           error=None if step == 0 else "CUDA out of memory (tried to allocate 2.1 GiB)"))
    # Queued 3 hours: past a lease plus a watchdog period (the site sets them to 15 min each, so
    # the runs seeded "now" stay within theirs however long the tests take), no worker took it.
    run("queued_eval", "eval", "queued").created_at = now - dt.timedelta(hours=3)
    run("queued_train", "train", "queued").created_at = now  # just submitted: waiting for a worker is normal
    cancelling = run("cancelling_eval", "eval", "cancelling")
    _episodes(s, cancelling, inst[0], 0, 0, "1R", now - dt.timedelta(minutes=3))
    _episodes(s, cancelling, inst[1], 0, 1, "CC", now - dt.timedelta(minutes=3))
    cancelled = run("cancelled_train", "train", "cancelled", error="cancelled by the user")
    _episodes(s, cancelled, inst[2], 0, 0, "0C", now - dt.timedelta(minutes=10))
    _lora_pair(s, inst, now, ids)
    _group_state_runs(s, inst, now, ids)


def _group_state_runs(s, inst: list[TaskInstance], now: dt.datetime, ids: dict) -> None:
    """Groups whose state the scheduler's `Group.status` alone would misname: a run whose step 0
    took a group sampled for step 1 (async), whose step 1 has all its groups so a group still
    sampling will never be trained, and a run whose step is training with a group waiting."""
    cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
                                    "group_size": 2, "tasks_per_step": 1, "steps": 2}).model_dump(mode="json")
    early = Run(kind="train", status="running", config=cfg, policy_version=1, created_at=now - dt.timedelta(minutes=9),
                started_at=now - dt.timedelta(minutes=9))
    s.add(early)
    s.flush()
    ids["early_train"] = early.id
    # (group, sampled for step, marks, status, step that took it, that step's status)
    for group, planned, marks, status, step, step_status in ((0, 0, "RR", "open", None, None),
                                                               (1, 1, "10", "trained", 0, "completed"),
                                                               (2, 0, "01", "trained", 1, "training"),
                                                               (3, 1, "Rq", "open", None, None)):
        eps = _episodes(s, early, inst[group % 3], planned, group, marks, now - dt.timedelta(minutes=8 - group))
        s.add(Group(run_id=early.id, group_index=group, instance_id=inst[group % 3].id, status=status, step=step))
        if step is not None:
            s.add(TrainingStep(run_id=early.id, step=step, status=step_status, episode_ids=[e.id for e in eps],
                               policy_version=step + 1 if step_status == "completed" else None,
                               started_at=now - dt.timedelta(minutes=3 - step),
                               finished_at=now - dt.timedelta(minutes=2) if step_status == "completed" else None))
        if group == 1:
            ids["early_episode"] = eps[0].id  # sampled for step 1, trained in step 0


def _lora_pair(s, inst: list[TaskInstance], now: dt.datetime, ids: dict) -> None:
    """Two LoRA train runs live on the default engine (two adapters on one base model), shares 1
    and 3, each with a trained step whose adapter the engines serve and rollouts in flight."""
    for label, share, digest in (("lora_a", 1.0, "3f9a0c1d2e4b"), ("lora_b", 3.0, "a41c77e09b25")):
        cfg = RunConfig.model_validate({"kind": "train", "harness": "mini-swe-agent", "task_set": "synthetic",
                                        "group_size": 2, "tasks_per_step": 2, "steps": 4, "training": {"lora": True},
                                        "scheduling": {"share": share}}).model_dump(mode="json")
        r = Run(kind="train", status="running", config=cfg, policy_version=1, created_at=now - dt.timedelta(minutes=12),
                started_at=now - dt.timedelta(minutes=12))
        s.add(r)
        s.flush()
        ids[label] = r.id
        eps = _episodes(s, r, inst[0], 0, 0, "10", now - dt.timedelta(minutes=10))
        eps += _episodes(s, r, inst[1], 0, 1, "01", now - dt.timedelta(minutes=10))
        for g in range(2):
            s.add(Group(run_id=r.id, group_index=g, instance_id=inst[g].id, status="trained", step=0))
        metrics = {**_step_metrics(0, [1.0, 0.0, 0.0, 1.0], random.Random(3)), "adapter": f"run-{r.id}@{digest}"}
        s.add(TrainingStep(run_id=r.id, step=0, status="completed", policy_version=1, episode_ids=[e.id for e in eps],
                           metrics=metrics, checkpoint_path=f"var/runs/{r.id}/checkpoints/step_0",
                           started_at=now - dt.timedelta(minutes=6), finished_at=now - dt.timedelta(minutes=5)))
        for g, marks in ((2, "RR"), (3, "Rq" if share == 1.0 else "RR")):
            s.add(Group(run_id=r.id, group_index=g, instance_id=inst[g % 3].id, status="open", step=1))
            _episodes(s, r, inst[g % 3], 1, g, marks, now - dt.timedelta(minutes=2))


LEARN_SERIES = "seedlearn01"


def _write_log(run_id: int, episode_id: int) -> None:
    folder = get_settings().var_dir / "runs" / str(run_id) / "episodes" / str(episode_id)
    folder.mkdir(parents=True, exist_ok=True)
    body = "\n".join(f"mini-swe-agent step {i}: ran a command" for i in range(300))
    (folder / "harness-attempt1.log").write_text(
        "$ mini-swe-agent (exit 0, 41.2 s, confined=True)\n--- stdout ---\n" + body + "\nSubmitted: calc.py fixed\n--- stderr ---\n")
