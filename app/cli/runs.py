"""Run commands: submit (and follow), follow, show, runs, export, cancel, and the demo."""
from __future__ import annotations

import argparse
import json
import sys

import httpx
from rich.table import Table

from app.cli import client, labels
from app.cli.report import make_console
from app.paths import RunPaths


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


SUBMIT_EXAMPLES = """examples:
  turnstile submit --config demo/train.json --follow          # the demo's train run (a config that learns)
  turnstile submit --set kind=eval --set task_set=starter --follow
  turnstile submit --config run.yaml --set steps=4           # --set overrides a field of the file
the run options: app/runconfig.py, or RunConfig in /api/openapi.json"""


def _assemble(path: str | None, sets: list[str]) -> tuple[dict, dict[str, str], str | None]:
    """The run config of `--config path` then `--set KEY=VALUE`s, where each leaf came from
    (`app.provenance`), and where its `warm_start` section came from (None: it has none)."""
    from app import provenance

    config: dict = client.read_config_file(path) if path else {}
    origins: dict[str, str] = {}
    provenance.mark(origins, config, provenance.FILE)
    warm_source = provenance.FILE if "warm_start" in config else None
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set group_size=4")
        _set(config, key, value)
        for stale in [p for p in origins if p == key or p.startswith(key + ".")]:
            del origins[stale]  # a --set of a section replaces the file's whole section
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            provenance.mark(origins, node, provenance.SET, key + ".")
        else:
            origins[key] = provenance.SET
        if key.split(".", 1)[0] == "warm_start":
            warm_source = provenance.SET
    return config, origins, warm_source


def _refused(message: str) -> int:
    """Print why the run is refused (nothing was submitted); the exit status 2 of bad input."""
    print(f"run rejected: {message}", file=sys.stderr)
    return 2


def _prepare(config: dict, origins: dict[str, str], warm_source: str | None) -> int:
    """Check the whole config, then run the warm start (when there is one and nothing overrides it):
    0 with `config` ready to submit (its `warm_start` section removed, `origins` updated in place),
    or 2 after printing why the run is refused.

    Order matters: every problem of the config (the API's checks against this installation, and the
    warm start's own inputs) is reported at once before the warm start's minutes of fine-tuning.
    A `model.checkpoint` from `--set` overrides a `warm_start` section of the file, which is then
    skipped and said so; from the same source they are refused (`app.provenance.checkpoint_conflict`).
    """
    from app import provenance

    section = config.pop("warm_start", None)
    for path in [p for p in origins if p.split(".", 1)[0] == "warm_start"]:
        del origins[path]  # not a run option: only the warm start reads it
    try:
        verdict = provenance.checkpoint_conflict(origins, warm_source if section is not None else None)
    except ValueError as exc:
        return _refused(str(exc))
    if verdict == "skip":
        print(f"warm start skipped: --set model.checkpoint={config['model']['checkpoint']} chooses the starting "
              "weights (it overrides the file's warm_start section)", file=sys.stderr)
        section = None
    problems = client.check_run(config, origins)
    if section is not None:
        from app.training.warmstart import section_problems

        problems += [{"field": f, "message": m} for f, m in section_problems(config, section, "starter:train")]
    if problems:
        lines = "\n".join(f"  {p['field']}: {p['message']}" if p.get("field") else f"  {p['message']}" for p in problems)
        return _refused(f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in the run config, nothing was "
                        f"submitted\n{lines}")
    if section is not None:
        from app.training.warmstart import warm_start_folder

        print("warm start: supervised fine-tuning on the fixes of its instances (reused when done before) ...",
              file=sys.stderr, flush=True)
        folder = warm_start_folder(config, section, "starter:train")
        print(f"warm start: {folder}", file=sys.stderr)
        config["model"] = {**(config.get("model") or {}), "checkpoint": str(folder)}
        origins["model.checkpoint"] = provenance.WARM_START
    return 0


def cmd_submit(args) -> int:
    if not args.config and not args.set:
        # Every option has a default, so an empty body is a real run (a 2-step train run): a bare
        # `submit` is a newcomer asking how, and gets the usage, not a run.
        args.parser.print_usage(sys.stderr)
        print("turnstile submit: give a run config (--config FILE) and/or fields (--set KEY=VALUE); nothing was "
              f"submitted\n{SUBMIT_EXAMPLES}", file=sys.stderr)
        return 2
    config, origins, warm_source = _assemble(args.config, args.set or [])
    labels.apply_submit_flags(config, args)  # name, tags, notes: checked with the config, before a warm start
    if _prepare(config, origins, warm_source):
        return 2
    run = client.submit_run(config, origins)
    print(f"run {run['id']} created ({run['kind']}, {run['config']['harness']}, task set {run['config']['task_set']})")
    if not args.follow:
        return 0
    return client.follow_to_end(run["id"], args.timeout)


def cmd_follow(args) -> int:
    return client.follow_to_end(args.run_id, args.timeout)


def cmd_show(args) -> int:
    """One run: what it is, where it stands (why it waits, if it does), its steps, and its summary once ended."""
    from app.transitions import TERMINAL

    with client.api_client() as api:
        run = api.get(f"/api/runs/{args.run_id}").raise_for_status().json()
    console = make_console()
    cfg = run["config"]
    model = cfg.get("model") or {}
    console.print(f"[bold]run {run['id']}[/bold] {run['kind']} · [bold]{run['status']}[/bold] · harness "
                  f"{cfg.get('harness')} · model {model.get('checkpoint') or model.get('name')} · task set {cfg.get('task_set')}"
                  + (f" ({len(cfg['instances'])} instances)" if cfg.get("instances") else ""))
    console.print(client.progress_line(run), markup=False, highlight=False)
    if run.get("error"):
        console.print(f"error: {run['error']}", markup=False)
    if run["status"] in TERMINAL and run.get("summary"):
        client.print_summary(run, console)
    elif run.get("steps"):
        console.print(client.steps_table(run))
    console.print(f"dashboard: {client.dashboard_url(run['id'])}", markup=False, highlight=False)
    return 0


def _harness_and_set(run: dict) -> tuple[str, str]:
    """The harness and task-set cells: a Tinker model's run has neither, but an SDK client and a base model."""
    cfg = run["config"]
    if run["kind"] == "tinker":
        return "tinker SDK", f"{cfg.get('model', {}).get('name', '')} LoRA r{cfg.get('training', {}).get('lora_r', '')}"
    return cfg.get("harness", ""), cfg.get("task_set", "")


def cmd_runs(args) -> int:
    with client.api_client() as api:
        resp = api.get("/api/runs", params={"limit": args.limit, **labels.filter_params(args)})
    if resp.status_code == 400:
        return labels.refused(resp, "runs filter")
    runs = resp.raise_for_status().json()["runs"]
    table = Table(title="runs")
    for col in ("id", "name, tags", "kind", "status", "harness", "task set", "version", "episodes", "reward", "resolved", "created"):
        table.add_column(col, overflow="fold")
    for r in runs:
        eps = ", ".join(f"{k}:{v}" for k, v in sorted(r["episodes_by_status"].items()))
        live = r.get("live") or {}
        reward = "-" if live.get("reward_mean") is None else f"{live['reward_mean']:.3f}"
        resolved = "-" if live.get("resolved_rate") is None else f"{live['resolved_rate']:.0%}"
        table.add_row(str(r["id"]), labels.labels_cell(r), r["kind"], r["status"], *_harness_and_set(r),
                      str(r["policy_version"]), eps, reward, resolved, (r["created_at"] or "")[:19])
    make_console().print(table)
    return 0


def cmd_export(args) -> int:
    n = 0
    timeout = httpx.Timeout(30.0, read=client.EXPORT_READ_TIMEOUT_S)
    with client.api_client() as api, api.stream("GET", f"/api/runs/{args.run_id}/export", timeout=timeout) as resp:
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
    with client.api_client() as api:
        resp = api.post(f"/api/runs/{args.run_id}/cancel")
    body = resp.json()
    if resp.status_code == 202:
        print(f"run {args.run_id}: {body['status']}")
        return 0
    print(f"run {args.run_id}: {body.get('error', {}).get('message', resp.text)}", file=sys.stderr)
    return 1


def cmd_demo(args) -> int:
    """Submit the demo run, follow it, export its trajectories, print the summary.

    A `warm_start` section in the config (see `app.training.warmstart.warm_start_folder`) first
    runs or reuses the supervised warm start, which the run then starts from (`model.checkpoint`).
    """
    config, origins, warm_source = _assemble(args.config, [])
    console = make_console()
    if _prepare(config, origins, warm_source):
        return 2
    run = client.submit_run(config, origins)
    console.print(f"run {run['id']} submitted: {config.get('kind')} {config.get('harness')} on "
                  f"{', '.join(config.get('instances') or [config.get('task_set')])}, "
                  f"group {config.get('group_size')} x {config.get('tasks_per_step')} tasks x {config.get('steps')} steps")
    final = client.follow_run(run["id"], timeout_s=args.timeout, console=console)
    export_path = RunPaths(run["id"]).trajectories
    export_path.parent.mkdir(parents=True, exist_ok=True)
    cmd_export(argparse.Namespace(run_id=run["id"], output=str(export_path)))
    summary = final.setdefault("summary", {}) or {}
    summary["export_path"] = str(export_path)
    steps = [st for st in final.get("steps", []) if st.get("checkpoint_path")]
    if steps:
        summary["checkpoint"] = steps[-1]["checkpoint_path"]
    final["summary"] = summary
    client.print_summary(final, console)
    return 0 if final["status"] == "completed" else 1


def register(sub) -> None:
    p = sub.add_parser("submit", help="create a run (train/eval/collect) and optionally follow it",
                       epilog=SUBMIT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="run config file: JSON, YAML (.yaml/.yml) or TOML (.toml); see /api/openapi.json. "
                                    "A `warm_start` section first runs (or reuses) that supervised warm start here")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. --set group_size=4")
    p.add_argument("--follow", action="store_true", help="show live progress until the run ends")
    p.add_argument("--timeout", type=float, default=None, help="give up following after this many seconds")
    labels.add_submit_flags(p)
    p.set_defaults(handler=cmd_submit, parser=p)

    p = sub.add_parser("follow", help="show live progress of a run until it ends, then its summary")
    p.add_argument("run_id", type=int)
    p.add_argument("--timeout", type=float, default=None)
    p.set_defaults(handler=cmd_follow)

    p = sub.add_parser("show", help="one run: its config, progress (and why it waits), steps or summary")
    p.add_argument("run_id", type=int)
    p.set_defaults(handler=cmd_show)

    p = sub.add_parser("runs", help="list runs")
    p.add_argument("--limit", type=int, default=20)
    labels.add_filter_flags(p)
    p.set_defaults(handler=cmd_runs)

    p = sub.add_parser("export", help="export a run's episodes, completions and trajectories as JSONL")
    p.add_argument("run_id", type=int)
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    p.set_defaults(handler=cmd_export)

    p = sub.add_parser("demo", help="submit the demo run, follow it, export it and print the summary")
    p.add_argument("--config", default="demo/train.json")
    p.add_argument("--timeout", type=float, default=3600)
    p.set_defaults(handler=cmd_demo)

    p = sub.add_parser("cancel", help="cancel a run")
    p.add_argument("run_id", type=int)
    p.set_defaults(handler=cmd_cancel)
