"""`turnstile compare BEFORE AFTER`: two eval runs side by side.

Prints the instances each run solved (some sample resolved it, from the run summaries), then
pass@1 per instance and overall with 95% paired clustered-bootstrap intervals, the difference
after - before, and the pooled resolved samples with Wilson intervals (`app.stats` holds the
statistics and their sources).  `--json FILE` also writes the comparison.
"""
from __future__ import annotations

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


def cmd_compare(args) -> int:
    from app.stats import compare_samples

    with client.api_client() as api:
        runs = [api.get(f"/api/runs/{rid}").raise_for_status().json() for rid in (args.before, args.after)]
        samples = [client.run_samples(api, rid) for rid in (args.before, args.after)]
    console = make_console()
    console.print(compare_table(*runs))
    result = compare_samples(*samples, replicates=args.replicates, seed=args.seed)
    console.print(comparison_table(*runs, *samples, result))
    if args.json:
        write_json(args.json, *runs, *samples, result)
    return 0


def register(sub) -> None:
    p = sub.add_parser("compare", help="before/after table of two eval runs (e.g. base model vs a checkpoint): "
                                        "instances solved, pass@1 with 95%% bootstrap intervals and of the difference")
    p.add_argument("before", type=int)
    p.add_argument("after", type=int)
    p.add_argument("--replicates", type=int, default=10000, help="bootstrap replicates (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.set_defaults(handler=cmd_compare)
