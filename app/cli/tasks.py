"""`python -m app tasks validate SET`: grade every instance's gold patch and an empty patch, list the bad ones."""
from __future__ import annotations

import argparse
import sys
import threading


def cmd_validate(args) -> int:
    from app.grading.validate import validate_instances
    from app.tasksets import load_task_set

    task_set = load_task_set(args.task_set)
    records = task_set.instances
    if args.instances:
        wanted = [i.strip() for i in args.instances.split(",") if i.strip()]
        unknown = [i for i in wanted if i not in task_set.by_id()]
        if unknown:
            raise ValueError(f"task set {task_set.name!r} has no instance {', '.join(map(repr, unknown))}")
        records = [task_set.get(i) for i in wanted]
    print(f"validating {len(records)} instance(s) of {task_set.name} ({task_set.path}): gold patch and empty patch, "
          f"{args.jobs} at a time", flush=True)
    print(f"formats: {', '.join(f'{k} {v}' for k, v in task_set.formats.items())}")
    for warning in task_set.warnings:  # unknown keys of published rows: reported, never dropped silently
        print(f"warning: {warning}")
    sys.stdout.flush()
    lock = threading.Lock()

    def show(check) -> None:
        with lock:
            if check.problems:
                print(f"BAD  {check.instance_id} ({check.seconds:.0f} s)")
                for problem in check.problems:
                    print(f"       - {problem}")
            else:
                print(f"ok   {check.instance_id}: gold resolves, empty does not ({check.seconds:.0f} s)")
            sys.stdout.flush()

    checks = validate_instances(records, jobs=args.jobs, timeout_s=args.timeout, on_result=show)
    bad = [c for c in checks if c.problems]
    unsolvable = [c.instance_id for c in checks if c.gold is not None and not c.gold.resolved]
    free = [c.instance_id for c in checks if c.empty is not None and c.empty.resolved]
    errors = [c.instance_id for c in checks if c.error]
    print(f"\n{len(checks) - len(bad)} of {len(checks)} instance(s) sound; "
          f"cannot be solved: {len(unsolvable)}{' (' + ', '.join(unsolvable) + ')' if unsolvable else ''}; "
          f"solved by an empty patch: {len(free)}{' (' + ', '.join(free) + ')' if free else ''}; "
          f"not graded: {len(errors)}{' (' + ', '.join(errors) + ')' if errors else ''}")
    return 1 if bad else 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def register(sub) -> None:
    p = sub.add_parser("tasks", help="task set commands")
    tsub = p.add_subparsers(dest="tasks_command", required=True)
    v = tsub.add_parser("validate", help="grade every instance's gold patch and an empty patch; list instances that "
                                         "cannot be solved or that an empty patch solves (exit 1 if any)")
    v.add_argument("task_set", metavar="SET", help="a named task set (synthetic, swebench-real) or a path")
    v.add_argument("--instances", help="comma-separated instance ids (default: all)")
    v.add_argument("--jobs", type=_positive, default=2, help="grades run at once (default 2)")
    v.add_argument("--timeout", type=_positive, default=1800, help="seconds allowed for one grade's tests (default 1800)")
    v.set_defaults(handler=cmd_validate)
