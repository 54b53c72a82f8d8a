"""`turnstile label RUN`: set, change or clear a run's name, tags and notes (PATCH /api/runs/<id>).

    turnstile label 3 --name "lr sweep 3e-5" --tag sweep --tag lr-3e-5
    turnstile label 3 --untag sweep --notes ""        # "" clears the notes (and --name "" the name)
"""
from __future__ import annotations

import argparse
import sys

from app.cli import client, labels


def cmd_label(args) -> int:
    body: dict = {}
    if args.name is not None:
        body["name"] = args.name
    if args.notes is not None:
        body["notes"] = args.notes
    if args.tag:
        body["add_tags"] = args.tag
    if args.untag:
        body["remove_tags"] = args.untag
    if not body:
        args.parser.print_usage(sys.stderr)
        print("turnstile label: give --name, --tag, --untag or --notes; nothing was changed", file=sys.stderr)
        return 2
    with client.api_client() as api:
        resp = api.patch(f"/api/runs/{args.run_id}", json=body)
    if resp.status_code == 400:
        return labels.refused(resp, f"labels of run {args.run_id}")
    run = resp.raise_for_status().json()
    shown = labels.labels_text(run) or "no name, no tags"
    print(f"run {run['id']}: {shown}" + (f"\nnotes: {run['notes']}" if run.get("notes") else ""))
    return 0


def register(sub) -> None:
    p = sub.add_parser("label", help="set or clear a run's name, tags and notes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_id", type=int)
    p.add_argument("--name", help='what to call the run ("" clears it)')
    p.add_argument("--tag", action="append", metavar="TAG", help="add a tag (repeatable)")
    p.add_argument("--untag", action="append", metavar="TAG", help="remove a tag (repeatable)")
    p.add_argument("--notes", help='free text about the run ("" clears it)')
    p.set_defaults(handler=cmd_label, parser=p)
