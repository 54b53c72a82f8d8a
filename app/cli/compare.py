"""`turnstile compare BEFORE AFTER`: two eval runs side by side; `turnstile diff A B`: two runs' configs.

`compare` first asks the API whether the two runs can be compared (`GET /api/compare`, decided by
`app.api.dashboard.compare.comparability`, as the compare page is): a run that is not a
completed eval, different instance sets, or an eval that samples a train run's policy on
instances it trained on are refused with the reasons and exit status 2, unless `--force`, which
compares them and prints a warning per mismatch.  Then it prints the instances each run solved
(some sample resolved it, from the run summaries), pass@1 per instance and overall with 95%
paired clustered-bootstrap intervals, the difference after - before, and the pooled resolved
samples with Wilson intervals (`app.stats` holds the statistics and their sources).  The table is
titled "held-out" only when the API found the after run's instances disjoint from its train
run's.  `--json FILE` also writes the comparison.
"""
from __future__ import annotations

import json
import sys

import httpx
from rich.markup import escape
from rich.table import Table

from app.cli import client
from app.cli.report import comparison_table, make_console, solved_of, write_json


def compare_table(before: dict, after: dict) -> Table:
    """Instances solved per run by two eval runs side by side, with resolved rates (the before/after table)."""
    table = Table(title=f"eval run {before['id']} vs {after['id']}")
    table.add_column("instance")
    for run in (before, after):
        ckpt = run["config"].get("model", {}).get("checkpoint") or run["config"].get("model", {}).get("name")
        table.add_column(f"run {run['id']} ({ckpt})")
    a, b = solved_of(before.get("summary")), solved_of(after.get("summary"))
    for name in sorted(set(a) | set(b)):
        table.add_row(name, *("-" if name not in d else ("solved" if d[name] else "not solved") for d in (a, b)))
    table.add_section()
    table.add_row("solved instances", *(f"{sum(d.values())}/{len(d)}" if d else "-" for d in (a, b)))
    table.add_row("resolved rate (all samples)",
                  *(f"{(r.get('summary') or {}).get('resolved_rate') or 0:.3f}" for r in (before, after)))
    return table


def api_error(resp: httpx.Response) -> str:
    """The message of an API error answer and each of its `details`, one per line."""
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{resp.status_code} {resp.text[:300]}"
    return "\n".join([err.get("message", ""), *(f"  - {d['message']}" for d in err.get("details") or [])])


def cmd_compare(args) -> int:
    from app.stats import compare_samples

    with client.api_client() as api:
        check = api.get("/api/compare", params={"a": args.before, "b": args.after, "force": int(args.force)})
        if check.status_code != 200:
            message = api_error(check)
            if check.status_code == 400:
                message = message.replace("add force=1", "add --force")
            print(f"turnstile compare: {message}", file=sys.stderr)
            return 2
        verdict = check.json()
        runs = [api.get(f"/api/runs/{rid}").raise_for_status().json() for rid in (args.before, args.after)]
        samples = [client.run_samples(api, rid) for rid in (args.before, args.after)]
    console = make_console()
    for warning in verdict["warnings"]:
        console.print(f"[bold yellow]warning:[/] {escape(warning)}")
    console.print(compare_table(*runs))
    if verdict["difference"] is None:
        print(f"turnstile compare: runs {args.before} and {args.after} share no graded instance: there is no "
              "paired difference to show", file=sys.stderr)
        return 2
    result = compare_samples(*samples, replicates=args.replicates, seed=args.seed)
    table = comparison_table(*runs, *samples, result)
    if not verdict["held_out"]:
        table.title = table.title.replace("held-out pass@1", "pass@1", 1)
    console.print(table)
    if args.json:
        write_json(args.json, *runs, *samples, result)
    return 0


def cmd_diff(args) -> int:
    with client.api_client() as api:
        resp = api.get(f"/api/runs/{args.a}/diff/{args.b}")
    if resp.status_code != 200:
        print(f"turnstile diff: {api_error(resp)}", file=sys.stderr)
        return 2
    rows = resp.json()["diff"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"runs {args.a} and {args.b} have the same config")
        return 0
    table = Table(title=f"config of run {args.a} vs run {args.b} ({len(rows)} keys differ)")
    for col in ("key", "change", f"run {args.a}", f"run {args.b}"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["key"], r["change"], "" if r["change"] == "added" else json.dumps(r["a"]),
                      "" if r["change"] == "removed" else json.dumps(r["b"]))
    make_console().print(table)
    return 0


def register(sub) -> None:
    p = sub.add_parser("compare", help="before/after table of two eval runs (e.g. base model vs a checkpoint): "
                                        "instances solved, pass@1 with 95%% bootstrap intervals and of the difference; "
                                        "runs that cannot be compared are refused (exit 2) unless --force")
    p.add_argument("before", type=int)
    p.add_argument("after", type=int)
    p.add_argument("--replicates", type=int, default=10000, help="bootstrap replicates (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.add_argument("--force", action="store_true",
                   help="compare runs that are refused (not completed, not evals, different instances, instances "
                        "the train run saw), with a warning for each mismatch")
    p.set_defaults(handler=cmd_compare)
    d = sub.add_parser("diff", help="config diff of two runs: the dotted keys that differ, added, removed or changed")
    d.add_argument("a", type=int)
    d.add_argument("b", type=int)
    d.add_argument("--json", action="store_true", help="print the diff as JSON: [{key, change, a, b}]")
    d.set_defaults(handler=cmd_diff)
