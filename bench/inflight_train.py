"""A short train run under each weight-update mode, same config and seed, side by side.

    scripts/with_stack.sh inflight .venv/bin/python bench/inflight_train.py            # keep, then wait
    scripts/with_stack.sh inflight .venv/bin/python bench/inflight_train.py --modes keep wait --steps 5

Needs the stack running (`scripts/with_stack.sh` starts it).  The config (`--config`, default
`demo/inflight-train.json`: full weights, so each step's push reaches the engine as a weight load;
a LoRA adapter load never pauses the engine under any mode) gets its `warm_start` section run or
reused once, then one run per `--modes` entry with `model.weight_update_mode` set to it, one after
the other on the same stack.  Printed per run and step: the mean reward of its trained groups,
the loss, the lag split of trained tokens (sampled 0 / 1 / 2+ versions behind the trainer), the mean
|trainer - rollout| logprob gap by lag (nats), the ratio quantiles r_t = exp(old - rollout), the
trainer's seconds and the weight push's seconds (under `wait` the push includes the drain of
running requests); then per run: wall seconds, episodes per minute and the push seconds' sum.
`--json PATH` also writes every number.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli import client  # noqa: E402
from app.training.warmstart import warm_start_folder  # noqa: E402

LAGS = ("lag0", "lag1", "lag2plus")


def _f(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def step_rows(run: dict) -> list[dict]:
    """One dict per trained step of a finished run (API shape) with the numbers this bench prints."""
    rows = []
    for st in (run.get("summary") or {}).get("steps") or []:
        m = st.get("metrics") or {}
        off = m.get("off_policy") or {}
        rows.append({"step": st["step"], "reward": st.get("reward_mean"), "loss": m.get("loss"),
                     "tokens": {lag: off.get(f"tokens_{lag}") for lag in LAGS},
                     "gap": {lag: off.get(f"logprob_gap_{lag}_mean_abs") for lag in LAGS},
                     "ratio_p01": off.get("ratio_p01"), "ratio_p99": off.get("ratio_p99"),
                     "train_s": m.get("step_time_s"), "push_s": m.get("engine_sync_time_s")})
    return rows


def run_totals(run: dict) -> dict:
    """Wall seconds from start to finish, episodes per minute, the steps' push seconds summed."""
    start, end = (dt.datetime.fromisoformat(run[k]) for k in ("started_at", "finished_at"))
    wall = (end - start).total_seconds()
    episodes = sum(((run.get("summary") or {}).get("episodes_by_status") or {}).values())
    pushes = [r["push_s"] for r in step_rows(run) if r["push_s"] is not None]
    return {"wall_s": wall, "episodes": episodes, "episodes_per_min": 60 * episodes / wall if wall else None,
            "push_s_sum": sum(pushes), "push_s_max": max(pushes, default=None), "status": run["status"]}


def print_run(mode: str, run: dict) -> None:
    print(f"\n{mode}: run {run['id']} {run['status']}")
    print(f"{'step':>4} {'reward':>7} {'loss':>8} {'lag 0/1/2+':>14} {'gap0':>8} {'gap1':>8} {'gap2+':>8} "
          f"{'r p01':>6} {'r p99':>6} {'train s':>8} {'push s':>7}")
    for r in step_rows(run):
        split = "/".join(str(r["tokens"][lag] if r["tokens"][lag] is not None else "-") for lag in LAGS)
        print(f"{r['step']:>4} {_f(r['reward']):>7} {_f(r['loss'], '.4f'):>8} {split:>14} "
              f"{_f(r['gap']['lag0'], '.1e'):>8} {_f(r['gap']['lag1'], '.1e'):>8} {_f(r['gap']['lag2plus'], '.1e'):>8} "
              f"{_f(r['ratio_p01'], '.2f'):>6} {_f(r['ratio_p99'], '.2f'):>6} {_f(r['train_s'], '.1f'):>8} "
              f"{_f(r['push_s'], '.2f'):>7}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="demo/inflight-train.json")
    parser.add_argument("--modes", nargs="+", default=["keep", "wait"], choices=["keep", "wait", "abort"])
    parser.add_argument("--steps", type=int, help="override the config's steps")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds to wait for each run")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args(argv)

    base = client.read_config_file(args.config)
    section = base.pop("warm_start", None)
    if section is not None:
        folder = warm_start_folder(base, section, "starter:train")
        print(f"warm start: {folder}", flush=True)
        base["model"] = {**(base.get("model") or {}), "checkpoint": str(folder)}
    if args.steps:
        base["steps"] = args.steps
    runs = {}
    for mode in args.modes:
        config = json.loads(json.dumps(base))
        config["model"]["weight_update_mode"] = mode
        created = client.submit_run(config)
        print(f"{mode}: run {created['id']} submitted", flush=True)
        runs[mode] = client.follow_run(created["id"], timeout_s=args.timeout)
    for mode, run in runs.items():
        print_run(mode, run)
    print(f"\n{'mode':<6} {'status':<10} {'wall s':>8} {'episodes':>8} {'eps/min':>8} {'push s sum':>10} {'push s max':>10} "
          f"{'reward mean':>11}")
    out = {}
    for mode, run in runs.items():
        totals = run_totals(run)
        rewards = [r["reward"] for r in step_rows(run) if r["reward"] is not None]
        totals["reward_mean"] = statistics.fmean(rewards) if rewards else None
        out[mode] = {"run_id": run["id"], "totals": totals, "steps": step_rows(run)}
        print(f"{mode:<6} {totals['status']:<10} {totals['wall_s']:>8.0f} {totals['episodes']:>8} "
              f"{_f(totals['episodes_per_min'], '.2f'):>8} {totals['push_s_sum']:>10.1f} {_f(totals['push_s_max'], '.1f'):>10} "
              f"{_f(totals['reward_mean']):>11}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if all(run["status"] == "completed" for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
