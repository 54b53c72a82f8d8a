"""`python -m app learn`: evaluate, train, evaluate again, compare, draw `var/runs/<id>/learning.png`.

    python -m app learn --config demo/learn.json       # what `make learn` runs (the stack must be up)
    python -m app warm-start --config demo/learn.json  # only the warm start (prints its model folder)
    python -m app learn-plot TRAIN_ID --compare FILE   # redraw the figure of a finished train run

The config file holds one train run config (`RunConfig`) plus a `learn` section:
`heldout` / `train` (instance ids, or the name of a split of the starter set: "starter:heldout",
"starter:train"), `eval_samples` (k samples per held-out instance), `eval_budget` (optional
budget for the eval runs, default the train run's), `warm_start` (optional: hyperparameters of
`app.training.warmstart.WarmStartConfig`).  Steps, in order:

0. with `warm_start`: supervised warm start on the train instances' fixes (cached by its
   inputs), which becomes `model.checkpoint` of every run below except the last;
1. eval run on the held-out instances with the starting policy (pass@1 over k samples each);
2. the train run on the train instances, from the same policy;
3. eval run on the held-out instances with the train run's newest checkpoint (`run:<id>`);
4. `compare` of 1 and 3 (95% bootstrap intervals, `app/cli/compare.py`), saved as
   `var/runs/<train id>/compare.json`, and the figure `var/runs/<train id>/learning.png`:
   the training reward per step (every episode drawn for it) with its moving average, and held-out pass@1 before and
   after with their 95% intervals.
"""
from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

from rich.console import Console

from app.cli.report import make_console
from app.config import get_settings
from app.paths import RunPaths

MOVING_AVERAGE = 3  # steps in the trailing moving average of the training reward


def moving_average(values: Sequence[float], window: int = MOVING_AVERAGE) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start); [] for []. Raises ValueError if window < 1."""
    if window < 1:
        raise ValueError(f"window must be at least 1, not {window}")
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1): i + 1]
        out.append(sum(part) / len(part))
    return out


def slope(values: Sequence[float]) -> float | None:
    """Least-squares slope of `values` against their index (reward per step); None for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return num / sum((i - mean_x) ** 2 for i in range(n))


def step_series(train_run: Mapping) -> tuple[list[int], list[float], list[float | None]]:
    """(steps, reward per step, loss per step) of a train run as the API returns it (`summary.steps`).

    The reward of a step is the mean over every episode drawn for it (`sampled_reward_mean`): with
    dynamic sampling the trained groups alone are the mixed ones, whose mean says nothing of progress.
    Runs summarised before that field existed fall back to `reward_mean` (the trained episodes).
    """
    rows = [st for st in (train_run.get("summary") or {}).get("steps") or [] if st.get("reward_mean") is not None]
    rewards = [float(st["reward_mean"] if st.get("sampled_reward_mean") is None else st["sampled_reward_mean"])
               for st in rows]
    return [int(st["step"]) for st in rows], rewards, [(st.get("metrics") or {}).get("loss") for st in rows]


def draw(path: Path, train_run: Mapping, comparison: Mapping | None) -> Path:
    """Write the two-panel figure to `path` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, rewards, _ = step_series(train_run)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    left.plot(steps, rewards, "o", color="#999999", label="reward mean of the episodes drawn for the step")
    left.plot(steps, moving_average(rewards), "-", color="#1f77b4", label=f"moving average ({MOVING_AVERAGE} steps)")
    left.set_xlabel("training step")
    left.set_ylabel("training reward")
    left.set_ylim(-0.05, 1.05)
    left.set_title(f"train run {train_run['id']}")
    left.legend(loc="upper left", fontsize=8)
    if comparison:
        names = ["before", "after"]
        values = [comparison["before"]["value"], comparison["after"]["value"]]
        errors = [[v - comparison[n]["low"] for n, v in zip(names, values)],
                  [comparison[n]["high"] - v for n, v in zip(names, values)]]
        right.bar(names, values, yerr=errors, capsize=8, color=["#bbbbbb", "#1f77b4"])
        d = comparison["difference"]
        right.set_title(f"held-out pass@1 (95% CI)\ndiff {d['value']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]", fontsize=10)
        right.set_ylim(0, 1.05)
    else:
        right.text(0.5, 0.5, "no held-out comparison", ha="center", va="center")
        right.set_axis_off()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _ids(spec: str | Sequence[str]) -> list[str]:
    """Instance ids from a list, or from "starter:train" / "starter:heldout" (the starter set's `split` field)."""
    if not isinstance(spec, str):
        return list(spec)
    name, _, split = spec.partition(":")
    from app.tasksets import load_task_set
    from app.cli.starter import split_ids

    ids = split_ids(load_task_set(name).raw, split)
    if not ids:
        raise ValueError(f"learn: {spec!r} names no instance (task set {name!r} has no split {split!r})")
    return ids


def _run(config: dict, console: Console, timeout_s: float | None) -> dict:
    from app.cli.runs import follow_run, print_summary, submit_run

    run = submit_run(config)
    console.print(f"run {run['id']} submitted: {config['kind']} on {len(config['instances'])} instance(s), "
                  f"group {config['group_size']}")
    final = follow_run(run["id"], timeout_s=timeout_s, console=console)
    print_summary(final, console)
    if final["status"] != "completed":
        raise SystemExit(f"run {run['id']} ended {final['status']}: {final.get('error') or 'see its page'}")
    return final


def warm_start_folder(config: dict, section: Mapping, default_instances: str | Sequence[str]) -> Path:
    """Run (or reuse) the supervised warm start described by `section`; its model folder.

    `section` holds `app.training.warmstart.WarmStartConfig` fields and optionally `instances`
    (ids or a starter split such as "starter:train"; default `default_instances`), the task set's
    instances whose fixes are demonstrated.  The base model and harness are the run config's.
    """
    from app.harnesses import get_preset
    from app.tasksets import load_task_set
    from app.training.warmstart import WarmStartConfig, warm_start

    settings = dict(section)
    names = _ids(settings.pop("instances", default_instances))
    task_set = load_task_set(config["task_set"])
    records = [task_set.get(name) for name in names]
    base = (config.get("model") or {}).get("name", "smollm2")
    args = (base, get_preset(config["harness"]), records, WarmStartConfig.from_dict(settings), get_settings().var_dir / "models")
    # In a child process: the model, its gradients and AdamW state (~4 GB for SmolLM2) go back to the
    # OS when it exits, instead of staying in this process for the hour it then follows the runs.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(warm_start, *args).result()


def cmd_learn(args) -> int:
    from app.cli.compare import compare_samples, comparison_table, samples_of, write_json
    from app.cli.runs import _client, read_config_file

    config = read_config_file(args.config)
    learn = config.pop("learn", None) or {}
    heldout, train_ids = _ids(learn.get("heldout", "starter:heldout")), _ids(learn.get("train", "starter:train"))
    k = int(learn.get("eval_samples", 4))
    console = make_console()
    config["model"] = dict(config.get("model") or {})
    if learn.get("warm_start") is not None:
        # The policy GRPO starts from, and the "before" of the comparison, is the warm-started one.
        config["model"]["checkpoint"] = str(warm_start_folder(config, learn["warm_start"], train_ids))
    eval_base = {key: config[key] for key in ("task_set", "harness", "timeouts") if key in config}
    eval_base.update(kind="eval", instances=heldout, group_size=k, tasks_per_step=len(heldout), steps=1,
                     budget=learn.get("eval_budget") or config.get("budget") or {}, model=dict(config["model"]))
    if "scheduling" in config:
        eval_base["scheduling"] = {s: v for s, v in config["scheduling"].items() if s in ("rollout_slots", "ready_depth")}
    before = _run(eval_base, console, args.timeout)
    train = _run({**config, "kind": "train", "instances": train_ids}, console, args.timeout)
    after_cfg = json.loads(json.dumps(eval_base))
    after_cfg["model"]["checkpoint"] = f"run:{train['id']}"
    after = _run(after_cfg, console, args.timeout)
    with _client() as client:
        samples = [samples_of(client.get(f"/api/runs/{r['id']}/episodes").raise_for_status().json()["episodes"])
                   for r in (before, after)]
    result = compare_samples(*samples, seed=0)
    paths = RunPaths(train["id"])
    paths.root.mkdir(parents=True, exist_ok=True)
    write_json(str(paths.compare), before, after, *samples, result)
    png = draw(paths.learning_png, train, json.loads(paths.compare.read_text()))
    console.print(comparison_table(before, after, *samples, result))
    _, rewards, losses = step_series(train)
    s = slope(rewards)
    console.print(f"training reward per step: {', '.join(f'{r:.3f}' for r in rewards)} (slope "
                  f"{'-' if s is None else f'{s:+.4f}'} per step); loss per step: "
                  f"{', '.join('-' if x is None else f'{x:.4g}' for x in losses)}")
    console.print(f"figure: {png}\ncomparison: {paths.compare}")
    return 0


def cmd_plot(args) -> int:
    from app.cli.runs import _client

    with _client() as client:
        train = client.get(f"/api/runs/{args.train_run}").raise_for_status().json()
    comparison = json.loads(Path(args.compare).read_text()) if args.compare else None
    out = Path(args.output) if args.output else RunPaths(train["id"]).learning_png
    print(draw(out, train, comparison))
    return 0


def cmd_warm_start(args) -> int:
    from app.cli.runs import read_config_file

    config = read_config_file(args.config)
    learn = config.pop("learn", None) or {}
    if learn.get("warm_start") is None:
        raise SystemExit(f"{args.config}: no learn.warm_start section")
    print(warm_start_folder(config, learn["warm_start"], learn.get("train", "starter:train")))
    return 0


def register(sub) -> None:
    p = sub.add_parser("learn", help="eval held-out, train, eval again, compare, draw learning.png (make learn)")
    p.add_argument("--config", default="demo/learn.json", help="train run config with a `learn` section")
    p.add_argument("--timeout", type=float, default=None, help="give up following one run after this many seconds")
    p.set_defaults(handler=cmd_learn)
    p = sub.add_parser("warm-start", help="the supervised warm start of a learn config (cached model folder)")
    p.add_argument("--config", default="demo/learn.json", help="train run config with a learn.warm_start section")
    p.set_defaults(handler=cmd_warm_start)
    p = sub.add_parser("learn-plot", help="draw learning.png of a finished train run")
    p.add_argument("train_run", type=int)
    p.add_argument("--compare", help="comparison JSON written by `compare --json` or `learn`")
    p.add_argument("-o", "--output", help="PNG path (default var/runs/<id>/learning.png)")
    p.set_defaults(handler=cmd_plot)
