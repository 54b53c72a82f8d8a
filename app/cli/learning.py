"""`turnstile learn`: evaluate, train, evaluate again, compare, draw `var/runs/<id>/learning.png`.

    turnstile learn --config demo/learn.json       # what `make learn` runs (the stack must be up)
    turnstile warm-start --config demo/learn.json  # only the warm start (prints its model folder)
    turnstile learn-plot TRAIN_ID --compare FILE   # redraw the figure of a finished train run

The config file holds one train run config (`RunConfig`) plus a `learn` section:
`heldout` / `train` (instance ids, or the name of a split of the starter set: "starter:heldout",
"starter:train"), `eval_samples` (k samples per held-out instance), `eval_budget` (optional
budget for the eval runs, default the train run's), `warm_start` (optional: hyperparameters of
`app.training.warmstart.WarmStartConfig`), `warm_start_count` (optional: demonstrate that many
instances of the warm start's, evenly spread), `out_of_family` (optional split spec).  Steps, in order:

0. with `warm_start`: supervised warm start on the train instances' fixes (cached by its
   inputs; `app.training.warmstart.warm_start_folder`, in a child process), which becomes
   `model.checkpoint` of every run below except the last;
1. eval run on the held-out instances with the starting policy (pass@1 over k samples each);
2. the train run on the train instances, from the same policy;
3. eval run on the held-out instances with the train run's newest checkpoint (`run:<id>`);
4. `compare` of 1 and 3 (95% bootstrap intervals, `app/stats.py`), saved as
   `var/runs/<train id>/compare.json`, and the figure `var/runs/<train id>/learning.png`:
   the training reward per step (every episode drawn for it) with its moving average and, with
   `eval_every` in the config, the held-out pass@1 curve (the train run's own evals, step 0 the
   "before" run) with 95% intervals; and held-out pass@1 before and after with their intervals.
   With `learn.out_of_family` (a split of bug kinds absent from train), that split is evaluated
   before and after too and compared on its own (`compare_out_of_family.json`).

`TURNSTILE_LEARN_SEED` (or `--seed`) draws everything random again: split specs of the learn
section get `@SEED` (the set's split under that seed; one that does not exist is an error), and
the trainer's and the warm start's seeds become SEED.  With `eval_every`, the train run's last
held-out eval (the newest checkpoint) is the "after" of the comparison.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Mapping, Sequence

from rich.console import Console

from app.cli import client
from app.cli.report import comparison_table, make_console, write_json
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
    points = [p for p in train_run.get("heldout") or [] if p.get("pass_at_1") is not None]
    if comparison:  # the "before" run is the curve's step 0
        points = [{"step": 0, "pass_at_1": comparison["before"]["value"], "low": comparison["before"]["low"],
                   "high": comparison["before"]["high"]}] + [p for p in points if p["step"] != 0]
    if points:
        xs, ys = [p["step"] for p in points], [p["pass_at_1"] for p in points]
        left.errorbar(xs, ys, yerr=[[y - p["low"] for y, p in zip(ys, points)], [p["high"] - y for y, p in zip(ys, points)]],
                      fmt="s-", color="#d62728", capsize=4, label="held-out pass@1 (95% CI)")
    left.set_xlabel("training step")
    left.set_ylabel("training reward / held-out pass@1")
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


def _run(config: dict, console: Console, timeout_s: float | None) -> dict:
    run = client.submit_run(config)
    console.print(f"run {run['id']} submitted: {config['kind']} on {len(config['instances'])} instance(s), "
                  f"group {config['group_size']}")
    final = client.follow_run(run["id"], timeout_s=timeout_s, console=console)
    client.print_summary(final, console)
    if final["status"] != "completed":
        raise SystemExit(f"run {run['id']} ended {final['status']}: {final.get('error') or 'see its page'}")
    return final


def seeded(spec, seed: int | None):
    """A split spec under split seed `seed` ("family:train" -> "family:train@1"); ids, a spec that
    names its seed already, and seed None are returned unchanged."""
    if seed is None or not isinstance(spec, str) or "@" in spec:
        return spec
    return f"{spec}@{seed}"


def learn_seed(value: str | None) -> int | None:
    """The seed of `TURNSTILE_LEARN_SEED` / `--seed` (None when unset); SystemExit when not an integer >= 0."""
    if value is None or str(value).strip() == "":
        return None
    if not str(value).strip().isdigit():
        raise SystemExit(f"TURNSTILE_LEARN_SEED / --seed: {value!r} is not a seed (an integer >= 0)")
    return int(value)


def _ids(spec) -> list[str]:
    from app.tasksets.starter import instance_ids

    try:
        return instance_ids(spec)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _split(samples: dict, names: Sequence[str]) -> dict:
    return {n: samples[n] for n in names if n in samples}


def warm_section(learn: Mapping, warm: Mapping, train_ids: list[str]) -> dict:
    """The warm start's settings with its instances resolved: `warm["instances"]` (default the
    train ids), cut to `learn["warm_start_count"]` evenly spread ones when given (a CPU epoch
    costs seconds per demonstration)."""
    out = {key: v for key, v in warm.items() if v is not None}
    pool = _ids(out.pop("instances", train_ids))
    if learn.get("warm_start_count"):
        count = min(int(learn["warm_start_count"]), len(pool))
        pool = [pool[i * len(pool) // count] for i in range(count)]
    return {**out, "instances": pool}


def warm_section_spec(warm: Mapping, train_ids: list[str]) -> dict:
    """The warm start's settings as `section_problems` checks them: its instances unresolved (a bad
    spec is a problem it names, where `warm_section` would exit)."""
    return {**{key: v for key, v in warm.items() if v is not None}, "instances": warm.get("instances") or train_ids}


def replaced_settings(config: Mapping, learn: Mapping, seed: int | None, train_ids: list[str],
                      heldout: list[str]) -> list[str]:
    """The settings of the file that `learn` would replace with other values, each as "field: why";
    [] when none.  `learn` sets the train run's kind and instances, with `eval_every` its held-out
    evals (`learn.heldout`, `learn.eval_samples`), and with `learn.warm_start` its starting weights:
    a file that sets one of them to something else is refused rather than silently overridden."""
    out = []
    if config.get("kind", "train") != "train":
        out.append(f"kind: learn's config is its train run's (kind 'train'), not {config['kind']!r}")
    if "instances" in config and _ids(seeded(config["instances"], seed)) != train_ids:
        out.append("instances: learn trains on learn.train; set the instances there")
    if config.get("eval_every"):
        if "eval_instances" in config and _ids(seeded(config["eval_instances"], seed)) != heldout:
            out.append("eval_instances: learn evaluates learn.heldout; set the held-out instances there")
        if "eval_samples" in config and config["eval_samples"] != int(learn.get("eval_samples", 4)):
            out.append("eval_samples: learn takes learn.eval_samples; set it there")
        if config.get("eval_first", False) is not False:
            out.append("eval_first: learn's 'before' run evaluates step 0; remove eval_first")
    if learn.get("warm_start") is not None and (config.get("model") or {}).get("checkpoint"):
        out.append("model.checkpoint: it and learn.warm_start both choose the weights the runs start from; remove one")
    return out


def _final_eval(train: Mapping, timeout_s: float | None, console: Console) -> dict | None:
    """The train run's last `eval_every` eval (the newest checkpoint on the held-out set), followed to its end."""
    steps = int(train["config"]["steps"])
    with client.api_client() as api:
        points = api.get(f"/api/runs/{train['id']}").raise_for_status().json().get("heldout") or []
    final = next((p for p in points if p["step"] == steps and p["run_id"]), None)
    if final is None:
        return None
    console.print(f"held-out eval of the final policy: run {final['run_id']}")
    run = client.follow_run(final["run_id"], timeout_s=timeout_s, console=console)
    if run["status"] != "completed":
        raise SystemExit(f"run {run['id']} ended {run['status']}: {run.get('error') or 'see its page'}")
    return run


def cmd_learn(args) -> int:
    import os

    from app.stats import compare_samples
    from app.training.warmstart import warm_start_folder

    config = client.read_config_file(args.config)
    learn = config.pop("learn", None) or {}
    seed = learn_seed(args.seed if args.seed is not None else os.environ.get("TURNSTILE_LEARN_SEED"))
    heldout = _ids(seeded(learn.get("heldout", "starter:heldout"), seed))
    train_ids = _ids(seeded(learn.get("train", "starter:train"), seed))
    ood = _ids(seeded(learn["out_of_family"], seed)) if learn.get("out_of_family") else []
    k = int(learn.get("eval_samples", 4))
    console = make_console()
    config["model"] = dict(config.get("model") or {})
    warm = learn.get("warm_start")
    refused = replaced_settings(config, learn, seed, train_ids, heldout)
    if seed is not None:
        # another draw of everything random: the split, the warm start's and the trainer's seeds
        if (config.get("training") or {}).get("seed", seed) != seed:
            console.print(f"seed {seed} (--seed / TURNSTILE_LEARN_SEED) replaces the file's training.seed "
                          f"{config['training']['seed']}")
        config["training"] = {**(config.get("training") or {}), "seed": seed}
        warm = None if warm is None else {**warm, "seed": seed, "instances": seeded(warm.get("instances"), seed)}
        console.print(f"seed {seed}: {len(train_ids)} train, {len(heldout)} held-out, {len(ood)} out-of-family instances")
    # every problem of the train run's config (and the warm start's inputs), before any warm start
    check = {**config, "kind": "train", "instances": train_ids}
    if config.get("eval_every"):
        check.update(eval_instances=heldout, eval_samples=k, eval_first=False)
    refused += [f"{p['field']}: {p['message']}" if p.get("field") else p["message"] for p in client.check_run(check, {})]
    if warm is not None:
        from app.training.warmstart import section_problems

        refused += [f"{f}: {m}" for f, m in section_problems(config, warm_section_spec(warm, train_ids), train_ids)]
    if refused:
        console.print(f"run rejected: {len(refused)} problem{'s' if len(refused) > 1 else ''} in {args.config}, "
                      "nothing was submitted\n" + "\n".join(f"  {line}" for line in refused), markup=False)
        return 2
    if warm is not None:
        # The policy GRPO starts from, and the "before" of the comparison, is the warm-started one.
        config["model"]["checkpoint"] = str(warm_start_folder(config, warm_section(learn, warm, train_ids), train_ids))
    if config.get("eval_every"):
        # the held-out curve of the train run; its step 0 is the "before" run below
        config.update(eval_instances=heldout, eval_samples=k, eval_first=False)
    eval_base = {key: config[key] for key in ("task_set", "harness", "timeouts") if key in config}
    eval_base.update(kind="eval", group_size=k, steps=1,
                     budget=learn.get("eval_budget") or config.get("budget") or {}, model=dict(config["model"]))
    if "scheduling" in config:
        eval_base["scheduling"] = {s: v for s, v in config["scheduling"].items() if s in ("rollout_slots", "ready_depth")}
    # one series id on the runs, so their dashboard pages link to each other
    series = {"kind": "learn", "id": uuid.uuid4().hex[:12]}
    before = _run({**eval_base, "instances": heldout + ood, "tasks_per_step": len(heldout) + len(ood),
                   "series": {**series, "role": "before"}}, console, args.timeout)
    train = _run({**config, "kind": "train", "instances": train_ids, "series": {**series, "role": "train"}},
                 console, args.timeout)
    after_cfg = json.loads(json.dumps(eval_base))
    after_cfg["model"]["checkpoint"] = f"run:{train['id']}"
    after = _final_eval(train, args.timeout, console) if config.get("eval_every") else None
    if after is None:
        after = _run({**after_cfg, "instances": heldout, "tasks_per_step": len(heldout),
                      "series": {**series, "role": "after"}}, console, args.timeout)
    with client.api_client() as api:
        before_all, after_held = (client.run_samples(api, r["id"]) for r in (before, after))
        train = api.get(f"/api/runs/{train['id']}").raise_for_status().json()  # with its held-out curve
    paths = RunPaths(train["id"])
    paths.root.mkdir(parents=True, exist_ok=True)
    before_held = _split(before_all, heldout)
    result = compare_samples(before_held, after_held, seed=0)
    write_json(str(paths.compare), before, after, before_held, after_held, result)
    console.print(comparison_table(before, after, before_held, after_held, result))
    ood_result = None
    if ood:
        after_ood = _run({**after_cfg, "instances": ood, "tasks_per_step": len(ood),
                          "series": {**series, "role": "after"}}, console, args.timeout)
        with client.api_client() as api:
            after_ood_samples = client.run_samples(api, after_ood["id"])
        ood_result = compare_samples(_split(before_all, ood), after_ood_samples, seed=0)
        write_json(str(paths.root / "compare_out_of_family.json"), before, after_ood, _split(before_all, ood),
                   after_ood_samples, ood_result)
        console.print("out-of-family split (bug kinds absent from train):")
        console.print(comparison_table(before, after_ood, _split(before_all, ood), after_ood_samples, ood_result))
    png = draw(paths.learning_png, train, json.loads(paths.compare.read_text()))
    _, rewards, losses = step_series(train)
    s = slope(rewards)
    console.print(f"training reward per step: {', '.join(f'{r:.3f}' for r in rewards)} (slope "
                  f"{'-' if s is None else f'{s:+.4f}'} per step); loss per step: "
                  f"{', '.join('-' if x is None else f'{x:.4g}' for x in losses)}")
    console.print(f"figure: {png}\ncomparison: {paths.compare}")
    return 0


def cmd_plot(args) -> int:
    with client.api_client() as api:
        train = api.get(f"/api/runs/{args.train_run}").raise_for_status().json()
    comparison = json.loads(Path(args.compare).read_text()) if args.compare else None
    out = Path(args.output) if args.output else RunPaths(train["id"]).learning_png
    print(draw(out, train, comparison))
    return 0


def cmd_warm_start(args) -> int:
    from app.training.warmstart import warm_start_folder

    config = client.read_config_file(args.config)
    learn = config.pop("learn", None) or {}
    if learn.get("warm_start") is None:
        raise SystemExit(f"{args.config}: no learn.warm_start section")
    train_ids = _ids(learn.get("train", "starter:train"))
    print(warm_start_folder(config, warm_section(learn, learn["warm_start"], train_ids), train_ids))
    return 0


def register(sub) -> None:
    p = sub.add_parser("learn", help="eval held-out, train, eval again, compare, draw learning.png (make learn)")
    p.add_argument("--config", default="demo/learn.json", help="train run config with a `learn` section")
    p.add_argument("--timeout", type=float, default=None, help="give up following one run after this many seconds")
    p.add_argument("--seed", default=None, help="split seed of the learn section's split specs, and the trainer's and "
                                                "warm start's seed (default: TURNSTILE_LEARN_SEED, else the config's)")
    p.set_defaults(handler=cmd_learn)
    p = sub.add_parser("warm-start", help="the supervised warm start of a learn config (cached model folder)")
    p.add_argument("--config", default="demo/learn.json", help="train run config with a learn.warm_start section")
    p.set_defaults(handler=cmd_warm_start)
    p = sub.add_parser("learn-plot", help="draw learning.png of a finished train run")
    p.add_argument("train_run", type=int)
    p.add_argument("--compare", help="comparison JSON written by `compare --json` or `learn`")
    p.add_argument("-o", "--output", help="PNG path (default var/runs/<id>/learning.png)")
    p.set_defaults(handler=cmd_plot)
