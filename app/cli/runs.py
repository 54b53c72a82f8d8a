"""Run commands: submit (and follow), follow, runs, export."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from app.cli.report import make_console
from app.config import get_settings
from app.paths import RunPaths



def _client() -> httpx.Client:
    """An HTTP client of the REST API that sends the API token (`app.auth.api_token`)."""
    from app.auth import auth_header

    return httpx.Client(base_url=get_settings().api_url, timeout=30, headers=auth_header())


def _list_fields() -> set[str]:
    """Dotted paths of the run options that take a list (`instances`, `model.engine_urls`, ...)."""
    from app.runconfig import RunConfig

    schema = RunConfig.model_json_schema()
    defs = schema.get("$defs", {})
    out: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for name, prop in (node.get("properties") or {}).items():
            options = prop.get("anyOf") or [prop]
            for option in options:
                if option.get("type") == "array":
                    out.add(prefix + name)
                ref = option.get("$ref")
                if ref:
                    walk(defs[ref.rsplit("/", 1)[-1]], f"{prefix}{name}.")

    walk(schema, "")
    return out


def read_config_file(path: str) -> dict:
    """A run config from a JSON, YAML (`.yaml`/`.yml`) or TOML (`.toml`) file, by its suffix.

    Raises ValueError naming the file on a parse error or when the top level is not a mapping,
    OSError when it cannot be read.
    """
    import tomllib

    import yaml

    text = Path(path).read_text()
    suffix = Path(path).suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            config = yaml.safe_load(text)
        elif suffix == ".toml":
            config = tomllib.loads(text)
        else:
            config = json.loads(text)
    except yaml.MarkedYAMLError as exc:  # multi-line by default: keep the problem and its position
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML: {exc.problem or exc.context}{where}") from None
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        kind = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}.get(suffix, "JSON")
        raise ValueError(f"{path}: not valid {kind}: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a run config must be a mapping of options, got {type(config).__name__}")
    return config


def _set(config: dict, dotted: str, raw: str) -> None:
    """Apply `a.b=value` to a nested dict; the value is parsed as JSON when it can be, and for a
    list option a plain `a,b` becomes `["a", "b"]` (so `--set instances=x,y` works unquoted)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if isinstance(value, (str, int, float)) and not isinstance(value, bool) and dotted in _list_fields():
        value = [part.strip() for part in raw.split(",") if part.strip()]
    keys = dotted.split(".")
    node = config
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def submit_run(config: dict) -> dict:
    """POST the config; returns the created run, or raises SystemExit with the API's error message."""
    with _client() as client:
        resp = client.post("/api/runs", json=config)
    if resp.status_code != 202:
        err = resp.json().get("error", {}) if resp.headers.get("content-type", "").startswith("application/json") else {}
        details = err.get("details") or []
        if len(details) > 1:  # every problem of the request, not only the first
            lines = [f"  {d['field']}: {d['message']}" if d.get("field") else f"  {d['message']}" for d in details]
            raise SystemExit(f"run rejected ({resp.status_code}): {len(details)} problems in the run config\n" + "\n".join(lines))
        raise SystemExit(f"run rejected ({resp.status_code}): {err.get('message', resp.text)}")
    return resp.json()


def _age_s(run: dict) -> float:
    """Seconds since the run was created (its age), whenever the command attached to it."""
    import datetime as dt

    created = run.get("created_at")
    if not created:
        return 0.0
    when = dt.datetime.fromisoformat(created)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (dt.datetime.now(dt.timezone.utc) - when).total_seconds())


def _progress_table(run: dict) -> Table:
    table = Table(title=f"run {run['id']} ({run['kind']}) — {run['status']}", expand=False)
    for col in ("state", "episodes"):
        table.add_column(col)
    from app.tables import EPISODE_STATES  # lazily: a CLI command that shows no progress loads no SQL models

    counts = run.get("episodes_by_status", {})
    for state in EPISODE_STATES:
        if counts.get(state):
            table.add_row(state, str(counts[state]))
    live = run.get("live") or {}
    steps = run.get("steps") or []
    done = [s for s in steps if s["status"] == "completed"]
    table.add_section()
    table.add_row("policy version", str(run.get("policy_version")))
    table.add_row("steps done", f"{len(done)}/{run['config'].get('steps')}" if run["kind"] == "train" else "-")
    if done and done[-1].get("metrics"):
        m = done[-1]["metrics"]
        if m.get("reward_mean") is not None:
            table.add_row("last step reward", f"{m['reward_mean']:.3f}")
    if live.get("reward_mean") is not None:
        table.add_row("reward (graded)", f"{live['reward_mean']:.3f} over {live['graded']}")
    table.add_row("completions", str(live.get("completions", 0)))
    elapsed = max(1e-6, _age_s(run))
    table.add_row("sampled tokens/s", f"{live.get('sampled_tokens', 0) / elapsed:.1f}")
    table.add_row("elapsed", f"{elapsed:.0f} s")
    return table


def progress_line(run: dict) -> str:
    """One line of progress for logs and pipes: status, episodes by state, steps, reward, age."""
    from app.tables import EPISODE_STATES

    counts = run.get("episodes_by_status") or {}
    parts = [f"run {run['id']} {run['status']}",
             "episodes " + (", ".join(f"{k} {counts[k]}" for k in EPISODE_STATES if counts.get(k)) or "none yet")]
    if run["kind"] == "train":
        done = sum(1 for st in run.get("steps") or [] if st["status"] == "completed")
        parts.append(f"steps {done}/{run['config'].get('steps')}")
    live = run.get("live") or {}
    if live.get("reward_mean") is not None:
        parts.append(f"reward {live['reward_mean']:.3f} over {live['graded']}")
    parts.append(f"elapsed {_age_s(run):.0f} s")
    return "; ".join(parts)


def follow_run(run_id: int, poll_s: float = 1.0, timeout_s: float | None = None, console: Console | None = None) -> dict:
    """Poll the run and show live progress until it ends; returns the final run dict.

    On a terminal the progress is a live table; otherwise (a pipe, a log file, CI) one line is
    printed whenever the progress changes.  Ctrl-C stops following, not the run: it raises
    `FollowInterrupted`, whose message says how to follow again or cancel.
    """
    console = console or make_console()
    started = time.monotonic()
    try:
        with _client() as client:
            if console.is_terminal:
                with Live(console=console, refresh_per_second=2, transient=False) as live:
                    return _poll(client, run_id, poll_s, timeout_s, started, lambda run: live.update(_progress_table(run)))
            last: list[str] = []

            def show(run: dict) -> None:
                line = progress_line(run)
                if [line.rsplit("; elapsed", 1)[0]] != last:  # print on change, not every poll
                    last[:] = [line.rsplit("; elapsed", 1)[0]]
                    print(line, flush=True)

            return _poll(client, run_id, poll_s, timeout_s, started, show)
    except KeyboardInterrupt:
        raise FollowInterrupted(run_id) from None


class FollowInterrupted(KeyboardInterrupt):
    """Ctrl-C while following: the run goes on; the message says how to get back to it."""

    def __init__(self, run_id: int):
        super().__init__(f"stopped following; run {run_id} continues. Follow it again with `python -m app follow {run_id}`, "
                         f"cancel it with `python -m app cancel {run_id}`.")


def _poll(client, run_id: int, poll_s: float, timeout_s: float | None, started: float, show) -> dict:
    from app.transitions import TERMINAL

    while True:
        run = client.get(f"/api/runs/{run_id}").raise_for_status().json()
        show(run)
        if run["status"] in TERMINAL:
            return run
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise SystemExit(f"run {run_id} still {run['status']} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def print_summary(run: dict, console: Console | None = None) -> None:
    from app.cli.report import render_summary

    render_summary(run, console or make_console())


def cmd_submit(args) -> int:
    config: dict = read_config_file(args.config) if args.config else {}
    for item in args.set or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set group_size=4")
        _set(config, key, value)
    run = submit_run(config)
    print(f"run {run['id']} created ({run['kind']}, {run['config']['harness']}, task set {run['config']['task_set']})")
    if not args.follow:
        return 0
    return _follow_to_end(run["id"], args.timeout)


def cmd_follow(args) -> int:
    return _follow_to_end(args.run_id, args.timeout)


def _follow_to_end(run_id: int, timeout_s: float | None) -> int:
    """Follow, then print the summary; 0 when the run completed, 1 when not, 130 on Ctrl-C."""
    try:
        final = follow_run(run_id, timeout_s=timeout_s)
    except FollowInterrupted as exc:
        print(exc, file=sys.stderr)
        return 130
    print_summary(final)
    return 0 if final["status"] == "completed" else 1


def cmd_runs(args) -> int:
    with _client() as client:
        runs = client.get("/api/runs", params={"limit": args.limit}).raise_for_status().json()["runs"]
    table = Table(title="runs")
    for col in ("id", "kind", "status", "harness", "task set", "version", "episodes", "reward", "resolved", "created"):
        table.add_column(col, overflow="fold")
    for r in runs:
        eps = ", ".join(f"{k}:{v}" for k, v in sorted(r["episodes_by_status"].items()))
        live = r.get("live") or {}
        reward = "-" if live.get("reward_mean") is None else f"{live['reward_mean']:.3f}"
        resolved = "-" if live.get("resolved_rate") is None else f"{live['resolved_rate']:.0%}"
        table.add_row(str(r["id"]), r["kind"], r["status"], r["config"].get("harness", ""), r["config"].get("task_set", ""),
                      str(r["policy_version"]), eps, reward, resolved, (r["created_at"] or "")[:19])
    make_console().print(table)
    return 0


def cmd_export(args) -> int:
    n = 0
    with _client() as client, client.stream("GET", f"/api/runs/{args.run_id}/export") as resp:
        if resp.status_code != 200:
            resp.read()
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:300]
            raise SystemExit(f"error: export of run {args.run_id}: {resp.status_code} {message}")
        out = open(args.output, "w") if args.output else sys.stdout  # only once the run exists
        for line in resp.iter_lines():
            if line:
                out.write(line + "\n")
                n += 1
    if args.output:
        out.close()
        print(f"wrote {n} episodes to {args.output}", file=sys.stderr)
    return 0


def cmd_cancel(args) -> int:
    with _client() as client:
        resp = client.post(f"/api/runs/{args.run_id}/cancel")
    body = resp.json()
    if resp.status_code == 202:
        print(f"run {args.run_id}: {body['status']}")
        return 0
    print(f"run {args.run_id}: {body.get('error', {}).get('message', resp.text)}", file=sys.stderr)
    return 1


def cmd_demo(args) -> int:
    """Submit the demo run, follow it, export its trajectories, print the summary.

    A `warm_start` section in the config (see `app.cli.learning.warm_start_folder`) first runs or
    reuses the supervised warm start, which the run then starts from (`model.checkpoint`).
    """
    config = read_config_file(args.config)
    console = make_console()
    section = config.pop("warm_start", None)
    if section is not None:
        from app.cli.learning import warm_start_folder

        folder = warm_start_folder(config, section, "starter:train")
        config["model"] = {**(config.get("model") or {}), "checkpoint": str(folder)}
    run = submit_run(config)
    console.print(f"run {run['id']} submitted: {config.get('kind')} {config.get('harness')} on "
                  f"{', '.join(config.get('instances') or [config.get('task_set')])}, "
                  f"group {config.get('group_size')} x {config.get('tasks_per_step')} tasks x {config.get('steps')} steps")
    final = follow_run(run["id"], timeout_s=args.timeout, console=console)
    export_path = RunPaths(run["id"]).trajectories
    export_path.parent.mkdir(parents=True, exist_ok=True)
    cmd_export(argparse.Namespace(run_id=run["id"], output=str(export_path)))
    summary = final.setdefault("summary", {}) or {}
    summary["export_path"] = str(export_path)
    steps = [st for st in final.get("steps", []) if st.get("checkpoint_path")]
    if steps:
        summary["checkpoint"] = steps[-1]["checkpoint_path"]
    final["summary"] = summary
    print_summary(final, console)
    return 0 if final["status"] == "completed" else 1


def register(sub) -> None:
    p = sub.add_parser("submit", help="create a run (train/eval/collect) and optionally follow it")
    p.add_argument("--config", help="run config file: JSON, YAML (.yaml/.yml) or TOML (.toml); see /api/openapi.json")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. --set group_size=4")
    p.add_argument("--follow", action="store_true", help="show live progress until the run ends")
    p.add_argument("--timeout", type=float, default=None, help="give up following after this many seconds")
    p.set_defaults(handler=cmd_submit)

    p = sub.add_parser("follow", help="show live progress of a run until it ends, then its summary")
    p.add_argument("run_id", type=int)
    p.add_argument("--timeout", type=float, default=None)
    p.set_defaults(handler=cmd_follow)

    p = sub.add_parser("runs", help="list runs")
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(handler=cmd_runs)

    p = sub.add_parser("export", help="export a run's episodes, completions and trajectories as JSONL")
    p.add_argument("run_id", type=int)
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("demo", help="submit the demo run, follow it, export it and print the summary")
    p.add_argument("--config", default="demo/train.json")
    p.add_argument("--timeout", type=float, default=3600)
    p.set_defaults(handler=cmd_demo)

    p = sub.add_parser("compare", help="before/after table of two eval runs (e.g. base model vs a checkpoint): "
                                        "pass@k per instance, pass@1 with 95%% bootstrap intervals and of the difference")
    p.add_argument("before", type=int)
    p.add_argument("after", type=int)
    p.add_argument("--replicates", type=int, default=10000, help="bootstrap replicates (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.set_defaults(handler=cmd_compare)

    p = sub.add_parser("cancel", help="cancel a run")
    p.add_argument("run_id", type=int)
    p.set_defaults(handler=cmd_cancel)


def compare_table(before: dict, after: dict) -> Table:
    """pass@k per instance of two eval runs side by side, with resolved rates (the before/after table)."""
    table = Table(title=f"eval run {before['id']} vs {after['id']}")
    table.add_column("instance")
    for run in (before, after):
        ckpt = run["config"].get("model", {}).get("checkpoint") or run["config"].get("model", {}).get("name")
        table.add_column(f"run {run['id']} ({ckpt})")
    a, b = (before.get("summary") or {}).get("pass_at_k", {}), (after.get("summary") or {}).get("pass_at_k", {})
    for name in sorted(set(a) | set(b)):
        table.add_row(name, *("-" if name not in d else ("pass" if d[name] else "fail") for d in (a, b)))
    table.add_section()
    table.add_row("pass@k", *(f"{sum(d.values())}/{len(d)}" if d else "-" for d in (a, b)))
    table.add_row("resolved rate (all samples)",
                  *(f"{(r.get('summary') or {}).get('resolved_rate') or 0:.3f}" for r in (before, after)))
    return table


def cmd_compare(args) -> int:
    from app.cli.compare import compare_samples, comparison_table, samples_of, write_json

    with _client() as client:
        runs = [client.get(f"/api/runs/{rid}").raise_for_status().json() for rid in (args.before, args.after)]
        samples = [samples_of(client.get(f"/api/runs/{rid}/episodes").raise_for_status().json()["episodes"])
                   for rid in (args.before, args.after)]
    console = make_console()
    console.print(compare_table(*runs))
    result = compare_samples(*samples, replicates=args.replicates, seed=args.seed)
    console.print(comparison_table(*runs, *samples, result))
    if args.json:
        write_json(args.json, *runs, *samples, result)
    return 0
