"""On-policy distillation against GRPO alone at one wall-clock budget, through the running stack.

Usage (the stack up: `make up`; the teacher folder linked once, see docs/distill.md)::

    .venv/bin/python bench/distill_demo.py --budget-min 30            # both arms, one after the other
    .venv/bin/python bench/distill_demo.py --report var/distill/demo.json   # print a saved result again

Steps, in order, each a run submitted to the REST API like any other:

1. one eval run of the starting policy (the student of both arms, `model` of the OPD config: the
   packaged SmolLM2, no warm start) on the held-out instances, `learn.eval_samples` samples each;
2. for each arm (`demo/distill.json`: OPD; `demo/distill-grpo.json`: GRPO alone), one after the
   other so that neither shares the engine or the two cores with the other: its train run with
   `steps` raised to `--max-steps`, cancelled when `--budget-min` minutes have passed since it
   started (both arms get the same wall-clock budget; the steps done by then are what it learned),
   then an eval run of its newest checkpoint (`run:<id>`) on the same held-out instances.

Figures, each before and after with a 95% interval (`app.stats`):

* held-out pass@1: paired clustered bootstrap of the two eval runs (`compare_samples`);
* tool-call rate of model calls: the share of the eval runs' recorded model calls whose answer
  holds a tool call (`choices[0].message.tool_calls`, OpenAI Chat Completions shape, which is what
  mini-swe-agent speaks), pooled with a Wilson interval, and per instance with the same paired
  clustered bootstrap (calls of one instance are correlated);
* the same for answers that hold the tool-call opening `<tool_call>` in their text, parsed or not
  (the teacher's format, which a student copies before it writes a whole call);
* per step of each train run: reward mean, loss and, for OPD, the reverse KL per token and per turn,
  tokens scored, teacher seconds per chain, teacher wait and the share of unscored chains.

Writes everything as JSON (`--out`, default `var/distill/demo-<time>.json`) and prints a Markdown
summary.  Exits 1 when a run ends other than completed or cancelled at the budget.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

from sqlalchemy import select

from app.cli import client
from app.config import get_settings
from app.db import session_scope
from app.stats import compare_samples, wilson
from app.tables import Completion, Episode, TaskInstance

OPD_METRICS = ("reverse_kl_per_token", "reverse_kl_per_turn", "tokens_scored", "teacher_seconds_per_chain",
               "teacher_wait_s", "chains_unscored_fraction")


def log(message: str) -> None:
    print(f"[{dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {message}", flush=True)


def eval_config(config: dict, checkpoint: str | None, role: str, series: str) -> dict:
    """The held-out eval run of `config` (a train config with a `learn` section), as `learn` builds it."""
    from app.tasksets.starter import instance_ids

    learn = config.get("learn") or {}
    heldout = instance_ids(learn.get("heldout", "starter:heldout"))
    out = {key: config[key] for key in ("task_set", "harness", "timeouts") if key in config}
    model = dict(config.get("model") or {})
    if checkpoint:
        model["checkpoint"] = checkpoint
    out.update(kind="eval", instances=heldout, group_size=int(learn.get("eval_samples", 4)),
               tasks_per_step=len(heldout), steps=1, budget=learn.get("eval_budget") or config.get("budget") or {},
               model=model, series={"kind": "learn", "id": series, "role": role})
    if "scheduling" in config:
        out["scheduling"] = {k: v for k, v in config["scheduling"].items() if k in ("rollout_slots", "ready_depth")}
    return out


def train_config(config: dict, max_steps: int, role: str, series: str) -> dict:
    """The train run of an arm: its config without `learn`, on the train instances, `steps` = max_steps."""
    from app.tasksets.starter import instance_ids

    learn = config.get("learn") or {}
    out = {k: v for k, v in config.items() if k != "learn"}
    out.update(kind="train", instances=instance_ids(learn.get("train", "starter:train")), steps=max_steps,
               series={"kind": "learn", "id": series, "role": role})
    return out


def wait_run(run_id: int, budget_s: float | None) -> tuple[dict, bool]:
    """Poll run `run_id` until it ends; cancel it once `budget_s` seconds have passed since it
    started running.  Returns (final run as the API shows it, whether the budget cancelled it)."""
    from app.transitions import TERMINAL

    started, cancelled, last = None, False, ""
    with client.api_client() as api:
        while True:
            run = api.get(f"/api/runs/{run_id}").raise_for_status().json()
            if run["status"] in TERMINAL:
                return run, cancelled
            line = client.progress_line(run).split("\n")[0]
            if line.split("; elapsed")[0] != last:
                last = line.split("; elapsed")[0]
                log(f"run {run_id}: {line}")
            if run["status"] == "running" and started is None:
                started = time.monotonic()
            if budget_s is not None and started is not None and not cancelled and time.monotonic() - started > budget_s:
                log(f"run {run_id}: budget of {budget_s / 60:.0f} min spent, cancelling")
                api.post(f"/api/runs/{run_id}/cancel").raise_for_status()
                cancelled = True
            time.sleep(5)


def adopt_and_wait(run_id: int, budget_s: float) -> tuple[dict, bool, float]:
    """`submit_and_wait` for a train run already running (a bench restarted mid-arm): the budget
    counts from the run's `started_at`, as if this process had submitted it."""
    with client.api_client() as api:
        run = api.get(f"/api/runs/{run_id}").raise_for_status().json()
    started = dt.datetime.fromisoformat(run["started_at"]).replace(tzinfo=dt.timezone.utc)
    spent = (dt.datetime.now(dt.timezone.utc) - started).total_seconds()
    log(f"run {run_id} adopted, {spent:.0f} s of its {budget_s:.0f} s budget spent")
    final, cancelled = wait_run(run_id, max(budget_s - spent, 0.0))
    seconds = (dt.datetime.now(dt.timezone.utc) - started).total_seconds()
    log(f"run {final['id']} ended {final['status']} after {seconds:.0f} s{' (budget)' if cancelled else ''}")
    return final, cancelled, seconds


def submit_and_wait(config: dict, budget_s: float | None = None) -> tuple[dict, bool, float]:
    """Submit `config`, wait for its end; (final run, cancelled at the budget, wall seconds)."""
    started = time.monotonic()
    run = client.submit_run(config)
    log(f"run {run['id']} submitted: {config['kind']} ({config.get('series', {}).get('role')})")
    final, cancelled = wait_run(run["id"], budget_s)
    seconds = time.monotonic() - started
    log(f"run {final['id']} ended {final['status']} after {seconds:.0f} s{' (budget)' if cancelled else ''}")
    if final["status"] != "completed" and not (cancelled and final["status"] == "cancelled"):
        raise SystemExit(f"run {final['id']} ended {final['status']}: {final.get('error') or 'see its page'}")
    return final, cancelled, seconds


def wait_for_teacher(config: dict, timeout_s: float = 3600.0) -> None:
    """Block until the teacher checkpoint folder of `config` holds a model (the warm start that
    makes it may still run); returns at once for a config without one."""
    folder = ((config.get("training") or {}).get("teacher") or {}).get("checkpoint")
    started = time.monotonic()
    while folder and not (Path(folder) / "config.json").is_file():
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"teacher folder {folder} has no model after {timeout_s:.0f} s")
        log(f"waiting for the teacher folder {folder}")
        time.sleep(30)


def first_message(response) -> dict:
    """`choices[0].message` of a recorded Chat Completions answer ({} when it has none)."""
    choices = response.get("choices") if isinstance(response, dict) else None
    message = (choices[0] or {}).get("message") if choices else None
    return message if isinstance(message, dict) else {}


def has_tool_call(response) -> bool:
    """Whether a recorded Chat Completions answer holds a tool call."""
    return bool(first_message(response).get("tool_calls"))


def has_call_opening(response) -> bool:
    """Whether a recorded Chat Completions answer holds the chat template's tool-call opening
    `<tool_call>` in its text, parsed into a call or not: the format a student copies from the
    teacher before it can write a call whole (an answer with a parsed call counts too)."""
    return has_tool_call(response) or "<tool_call>" in str(first_message(response).get("content") or "")


def tool_calls(run_id: int, test=has_tool_call) -> dict[str, list[bool]]:
    """Instance id -> one flag per recorded model call of run `run_id` (the episodes' current
    attempts, calls that sampled): `test(answer)`, by default whether it holds a tool call."""
    out: dict[str, list[bool]] = {}
    with session_scope() as s:
        rows = s.execute(
            select(TaskInstance.instance_id, Completion.response)
            .join(Episode, Episode.id == Completion.episode_id).join(TaskInstance, TaskInstance.id == Episode.instance_id)
            .where(Episode.run_id == run_id, Completion.attempt == Episode.attempts,
                   Completion.sampled_ids.is_not(None), Completion.error.is_(None))
            .order_by(Completion.id))
        for instance, response in rows:
            out.setdefault(instance, []).append(test(response))
    return out


def rate(flags: dict[str, list[bool]]) -> dict:
    """Pooled rate of `flags` with its 95% Wilson interval."""
    n = sum(len(v) for v in flags.values())
    k = sum(sum(v) for v in flags.values())
    low, high = wilson(k, n)
    return {"calls": n, "tool_calls": k, "rate": k / n if n else None, "wilson_95": [low, high]}


def steps_of(run: dict) -> list[dict]:
    """Per completed step of a train run: reward mean, loss and the distillation metrics."""
    out = []
    for st in run.get("steps") or []:
        if st["status"] != "completed":
            continue
        m = st.get("metrics") or {}
        opd = m.get("opd") or {}
        out.append({"step": st["step"], "reward_mean": m.get("reward_mean"), "loss": m.get("loss"),
                    "topk_forward_kl": m.get("topk_forward_kl"), **{k: opd.get(k) for k in OPD_METRICS if k in opd}})
    return out


def arm_figures(before: dict, after: dict, train: dict, cancelled: bool, seconds: float) -> dict:
    with client.api_client() as api:
        samples = [client.run_samples(api, r["id"]) for r in (before, after)]
    calls = [tool_calls(r["id"]) for r in (before, after)]
    pass1 = compare_samples(*samples, seed=0).to_dict()
    figures = {"train_run": train["id"], "eval_after_run": after["id"], "train_wall_s": round(seconds),
               "cancelled_at_budget": cancelled, "steps_completed": len(steps_of(train)),
               "pass_at_1": pass1, "tool_call_rate": {"before": rate(calls[0]), "after": rate(calls[1])},
               "steps": steps_of(train)}
    openings = [tool_calls(r["id"], has_call_opening) for r in (before, after)]
    figures["call_opening_rate"] = {"before": rate(openings[0]), "after": rate(openings[1])}
    for key, flags in (("tool_call_rate", calls), ("call_opening_rate", openings)):
        try:
            figures[key]["per_instance_bootstrap"] = compare_samples(*flags, seed=0).to_dict()
        except ValueError as exc:  # no instance with calls in both runs
            figures[key]["per_instance_bootstrap"] = {"error": str(exc)}
    return figures


def markdown(result: dict) -> str:
    def iv(d: dict) -> str:
        return f"{d['value']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"

    def tc(d: dict) -> str:
        return f"{d['tool_calls']}/{d['calls']} = {d['rate'] or 0:.3f} [{d['wilson_95'][0]:.3f}, {d['wilson_95'][1]:.3f}]"

    lines = ["| arm | steps in budget | tool-call rate before | after | `<tool_call>` opening before | after "
             "| held-out pass@1 before | after | difference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, arm in result["arms"].items():
        p, t = arm["pass_at_1"], arm["tool_call_rate"]
        o = arm.get("call_opening_rate") or {"before": None, "after": None}
        opening = [tc(o[k]) if o[k] else "-" for k in ("before", "after")]
        lines.append(f"| {name} (run {arm['train_run']}) | {arm['steps_completed']} in {arm['train_wall_s'] / 60:.1f} min | "
                     f"{tc(t['before'])} | {tc(t['after'])} | {opening[0]} | {opening[1]} | "
                     f"{iv(p['before'])} | {iv(p['after'])} | {iv(p['difference'])} |")
    for name, arm in result["arms"].items():
        lines.append(f"\n{name} per step: " + "; ".join(
            f"{st['step']}: " + ", ".join(f"{k} {v:.4g}" for k, v in st.items() if k != "step" and isinstance(v, (int, float)))
            for st in arm["steps"]))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--opd", default="demo/distill.json")
    parser.add_argument("--grpo", default="demo/distill-grpo.json")
    parser.add_argument("--arms", default="opd,grpo", help="which arms, in order (opd, grpo)")
    parser.add_argument("--budget-min", type=float, default=30.0, help="wall-clock budget of each train run")
    parser.add_argument("--max-steps", type=int, default=40, help="steps of each train run (the budget ends it first)")
    parser.add_argument("--before-run", type=int, help="reuse this finished eval run as the 'before'")
    parser.add_argument("--first-train-run", type=int, help="adopt this running train run as the first arm's "
                                                           "(the budget counts from its started_at)")
    parser.add_argument("--agent-s", type=int, help="override timeouts.agent_s of every run (a loaded box answers "
                                                   "the first calls of 8 concurrent episodes slowly)")
    parser.add_argument("--out", help="JSON result (default var/distill/demo-<time>.json)")
    parser.add_argument("--report", help="print the Markdown summary of a saved result and exit")
    args = parser.parse_args()
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return 0
    configs = {"opd": client.read_config_file(args.opd), "grpo": client.read_config_file(args.grpo)}
    if args.agent_s:
        for config in configs.values():
            config["timeouts"] = {**(config.get("timeouts") or {}), "agent_s": args.agent_s}
    out = Path(args.out or get_settings().var_dir / "distill" / f"demo-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    series = out.stem
    result = {"budget_min": args.budget_min, "configs": {"opd": args.opd, "grpo": args.grpo}, "arms": {},
              "started": dt.datetime.now(dt.timezone.utc).isoformat()}
    if args.before_run:
        before, _ = wait_run(args.before_run, None)
    else:
        first = args.arms.split(",")[0]
        before, _, seconds = submit_and_wait(eval_config(configs[first], None, "before", f"{series}-{first}"))
        result["eval_before_wall_s"] = round(seconds)
    result["eval_before_run"] = before["id"]
    for name in args.arms.split(","):
        arm_series = f"{series}-{name}"  # one series per arm: its train run and its eval after
        wait_for_teacher(configs[name])
        if args.first_train_run and name == args.arms.split(",")[0]:
            train, cancelled, seconds = adopt_and_wait(args.first_train_run, args.budget_min * 60)
        else:
            train, cancelled, seconds = submit_and_wait(
                train_config(configs[name], args.max_steps, "train", arm_series), args.budget_min * 60)
        after, _, _ = submit_and_wait(eval_config(configs[name], f"run:{train['id']}", "after", arm_series))
        result["arms"][name] = arm_figures(before, after, train, cancelled, seconds)
        out.write_text(json.dumps(result, indent=1))
        log(f"{name}: written to {out}")
    result["finished"] = dt.datetime.now(dt.timezone.utc).isoformat()
    out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f"result: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
