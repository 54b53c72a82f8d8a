"""`turnstile harness install|check|list NAME|all`: install the pinned CLIs and check them end to end.

* `install NAME|all` installs into `<var_dir>/tools` (idempotent; prints time and size).
* `check NAME|all` runs each CLI once, headless, against a fresh gateway (gunicorn
  subprocess) backed by a scripted engine (`app.conformance`), and prints: exit status, completions
  captured (with token ids), API spoken, merge fidelity, the diff, seconds.
  `--json` prints one JSON object per harness instead; `--keep DIR` keeps each check's
  captures (SQLite database) in `DIR/NAME`.  Exit code 1 when any check fails.
  `--pipeline` instead submits a `collect` run per harness through the REST API to a
  real Celery worker (sandboxed runtime of a real task instance, grading, trajectories).
* `list` shows the presets, pinned versions, APIs and whether each is installed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from app.harnesses import PRESETS, get_preset
from app.harnesses.base import HarnessInstallError


def _names(name: str) -> list[str]:
    if name == "all":
        return list(PRESETS)
    try:
        get_preset(name)
    except ValueError as exc:
        raise SystemExit(f"error: {exc} (or all)") from None
    return [name]


def _size(path) -> str:
    proc = subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True)
    return proc.stdout.split()[0] if proc.returncode == 0 and proc.stdout else "?"


def cmd_install(args) -> int:
    failed = 0
    for name in _names(args.name):
        preset = get_preset(name)
        try:
            seconds = preset.install(log=lambda msg: print(msg, flush=True))
        except HarnessInstallError as exc:
            print(f"FAILED {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        what = "already installed" if seconds == 0.0 else f"installed in {seconds:.0f} s"
        print(f"{name} {preset.version}: {what} ({_size(preset.root)}) at {preset.root}", flush=True)
    return 1 if failed else 0


def cmd_list(args) -> int:
    for name, preset in PRESETS.items():
        state = "installed" if preset.is_installed() else "not installed"
        print(f"{name:15} {preset.package + '@' + preset.version:40} api={preset.api:10} {state}")
    return 0


def _print_report(r) -> None:
    status = "timeout" if r.timed_out else f"exit {r.exit_code}"
    merge = r.merge or {}
    print(f"{'PASS' if r.ok else 'FAIL'} {r.harness} {r.version}: {status} in {r.seconds:.1f} s; "
          f"completions {r.completions} ({r.completions_with_ids} with prompt ids, sampled ids, logprobs); "
          f"API {','.join(r.apis) or '-'} (expected {r.api_expected}); "
          f"merge: {merge.get('chains')} chains, {merge.get('completions_merged')} merged, "
          f"fidelity {merge.get('fidelity')} over {merge.get('continuing')} continuing calls, "
          f"{merge.get('spliced')} spliced, cuts {merge.get('cut_reasons')}; "
          f"diff {'has' if r.patch else 'lacks'} the edit; token leaked: {r.token_leaked}", flush=True)
    for problem in r.problems:
        print(f"    problem: {problem}")
    if not r.ok and r.log_tail:
        print("    --- CLI output (tail) ---\n" + "\n".join("    " + line for line in r.log_tail.splitlines()[-25:]))


def _check_redis_url(explicit: str | None) -> str:
    """Redis DB for the pipeline check's queues: --redis-url, TURNSTILE_CHECK_REDIS_URL, else DB 15 of REDIS_URL."""
    from urllib.parse import urlsplit, urlunsplit

    from app.config import get_settings

    url = explicit or get_settings().check_redis_url
    if url:
        return url
    parts = urlsplit(get_settings().redis_url)
    return urlunsplit((parts.scheme, parts.netloc, "/15", "", ""))


def cmd_check_pipeline(args) -> int:
    from app.conformance.pipeline_check import run_pipeline_checks

    names = [n for n in _names(args.name)]
    missing = [n for n in names if not get_preset(n).is_installed()]
    if missing:
        print(f"FAIL not installed: {', '.join(missing)} (turnstile harness install NAME)", file=sys.stderr)
        return 1
    redis_url = _check_redis_url(args.redis_url)
    print(f"pipeline check of {', '.join(names)} (collect runs on task set {args.task_set}; queues on {redis_url})",
          flush=True)
    reports = run_pipeline_checks(names, redis_url=redis_url, task_set=args.task_set, instance=args.instance,
                                  timeout_s=max(300.0, args.timeout * len(names)), agent_s=int(args.timeout))
    for r in reports:
        if args.json:
            print(json.dumps(r.as_dict()), flush=True)
            continue
        merge = (r.merge_stats or {}).get("prefix_merging") or {}
        print(f"{'PASS' if r.ok else 'FAIL'} {r.harness}: episode {r.episode_status}, {r.exit_status}, "
              f"rollout {r.rollout_seconds} s; completions {r.completions} ({r.completions_with_ids} with ids); "
              f"API {','.join(r.apis) or '-'} (expected {r.api_expected}); merge: {merge.get('chains')} chains, "
              f"{merge.get('completions_merged')} merged, cuts {merge.get('cut_reasons')}; "
              f"edit in patch: {r.edit_in_patch}", flush=True)
        for problem in r.problems:
            print(f"    problem: {problem}")
    return 0 if all(r.ok for r in reports) else 1


def cmd_check(args) -> int:
    from app.conformance.harness_check import run_check

    if args.pipeline:
        return cmd_check_pipeline(args)
    failed = 0
    for name in _names(args.name):
        t0 = time.monotonic()
        try:
            workdir = Path(args.keep) / name if args.keep else None
            report = run_check(name, timeout_s=args.timeout, workdir=workdir, splice_history=not args.no_splice)
        except HarnessInstallError as exc:
            print(f"FAIL {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        if args.json:
            print(json.dumps({**report.as_dict(), "total_seconds": round(time.monotonic() - t0, 2)}), flush=True)
        else:
            _print_report(report)
        failed += not report.ok
    return 1 if failed else 0


def register(sub) -> None:
    """Add the `harness` command (with install / check / list) to the top-level subparsers."""
    p = sub.add_parser("harness", help="install and check the harness CLIs (presets)")
    hs = p.add_subparsers(dest="harness_command", required=True)
    names = ", ".join(PRESETS)

    q = hs.add_parser("install", help="install a harness CLI (pinned version) into var/tools")
    q.add_argument("name", help=f"one of {names}, or all")
    q.set_defaults(handler=cmd_install)

    q = hs.add_parser("check", help="run a harness against the gateway + a scripted engine and report")
    q.add_argument("name", help=f"one of {names}, or all")
    q.add_argument("--timeout", type=float, default=120.0, help="seconds the CLI may run (default 120)")
    q.add_argument("--json", action="store_true", help="print one JSON report per harness")
    q.add_argument("--keep", default=None, metavar="DIR",
                   help="keep each check's database, logs and workspace in DIR/NAME (an empty or new folder); "
                        "bench/prefix_merging_captures.py reads the captured sessions from there")
    q.add_argument("--no-splice", action="store_true",
                   help="render every turn from the harness's text (run option splice_history=false), for comparison")
    q.add_argument("--pipeline", action="store_true",
                   help="go through the real pipeline: a collect run per harness via the REST API and a Celery "
                        "worker, in the sandboxed runtime of a real task instance")
    q.add_argument("--task-set", default="synthetic", help="task set of the pipeline check (default synthetic)")
    q.add_argument("--instance", default=None, help="instance id of the pipeline check (default: the first)")
    q.add_argument("--redis-url", default=None,
                   help="Redis DB for the pipeline check's queues (default: DB 15 of REDIS_URL; never a deployment's)")
    q.set_defaults(handler=cmd_check)

    q = hs.add_parser("list", help="list the presets and whether they are installed")
    q.set_defaults(handler=cmd_list)
