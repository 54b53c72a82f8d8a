"""Run names, tags and notes on the command line: the flags `submit`, `runs` and `label` share.

Shared by the command modules (like `app.cli.client`); the API checks every value
(`app.api.labels`), so a bad tag is refused with the API's reason, exit status 2.
"""
from __future__ import annotations

import sys




def add_submit_flags(parser) -> None:
    """`--name`, `--tag` (repeatable), `--notes` of `submit`."""
    parser.add_argument("--name", help="what to call the run (the dashboard, `turnstile runs` and TensorBoard show it)")
    parser.add_argument("--tag", action="append", metavar="TAG", help="tag the run (repeatable): lowercase letters, "
                                                                      "digits and _ . : + = -")
    parser.add_argument("--notes", help="free text about the run")


def apply_submit_flags(config: dict, args) -> None:
    """Put the flags' labels into the request body `config`: `--name` and `--notes` replace the
    file's `name` / `notes`, `--tag` adds to its `tags`."""
    if args.name is not None:
        config["name"] = args.name
    if args.notes is not None:
        config["notes"] = args.notes
    if args.tag:
        given = config.get("tags")
        config["tags"] = (list(given) if isinstance(given, list) else [] if given is None else [given]) + args.tag


def add_filter_flags(parser) -> None:
    """`--search`, `--tag` (repeatable), `--kind`, `--status` of `runs`."""
    from app.tables import RUN_KINDS, RUN_STATES

    parser.add_argument("-q", "--search", metavar="TEXT", help="runs whose name, notes or tags contain TEXT (any case)")
    parser.add_argument("--tag", action="append", metavar="TAG", help="runs with this tag (repeatable: every one)")
    parser.add_argument("--kind", choices=RUN_KINDS)
    parser.add_argument("--status", choices=RUN_STATES)


def filter_params(args) -> dict:
    """The query arguments of GET /api/runs for the filter flags."""
    out = {"q": args.search, "kind": args.kind, "status": args.status}
    out = {k: v for k, v in out.items() if v}
    if args.tag:
        out["tag"] = ",".join(args.tag)
    return out


def refused(resp, what: str) -> int:
    """Print a 400's problems (each field and its reason) and return 2, the exit status of bad input."""
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": resp.text[:300]}
    details = error.get("details") or [{"field": error.get("field"), "message": error.get("message")}]
    lines = "\n".join(f"  {d['field']}: {d['message']}" if d.get("field") else f"  {d['message']}" for d in details)
    print(f"{what} refused ({resp.status_code}):\n{lines}", file=sys.stderr)
    return 2


def labels_text(run: dict) -> str:
    """`name [tag, tag]` of a run for tables ("" when it has neither)."""
    tags = run.get("tags") or []
    return " ".join(p for p in (run.get("name") or "", f"[{', '.join(tags)}]" if tags else "") if p)




def labels_cell(run: dict):
    """`labels_text` as a rich `Text` for a table cell: shown as typed (a `[...]` is no markup)."""
    from rich.text import Text

    return Text(labels_text(run))
