"""`turnstile tasks list [SET]`: the named task sets, or one set's instances; `turnstile tasks validate SET`:
grade every instance's gold patch and an empty patch, list the bad ones; `turnstile tasks prefetch SET`:
pull every image the set's instances name into this node's image cache.

Both read the task set on this machine (the files the workers read), not through the API.
"""
from __future__ import annotations

import sys
import threading

from app.cli import pulls


def cmd_validate(args) -> int:
    from app.grading.validate import validate_instances
    from app.tasksets import load_task_set

    task_set = load_task_set(args.task_set)
    records = _selected(task_set, args.instances)
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
            for note in check.surface_notes:  # what the grader put back or kept, and why
                print(f"       · {note}")
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


def _selected(task_set, instances: str | None) -> list:
    """The records of `task_set` named by `instances` (comma-separated ids), all when None; raises
    ValueError naming the ids the set lacks."""
    if not instances:
        return list(task_set.instances)
    wanted = [i.strip() for i in instances.split(",") if i.strip()]
    unknown = [i for i in wanted if i not in task_set.by_id()]
    if unknown:
        raise ValueError(f"task set {task_set.name!r} has no instance {', '.join(map(repr, unknown))}")
    return [task_set.get(i) for i in wanted]


def cmd_prefetch(args) -> int:
    """Pull each distinct image of the set's instances (the `image` an `oci` runtime is prepared
    from: `OciRuntime.prepare` takes `record.image`); instances that name none run on the local
    runtime and need nothing pulled."""
    from app.cli.pulls import pull_all
    from app.cli.report import make_console
    from app.tasksets import load_task_set

    console = make_console()
    task_set = load_task_set(args.task_set)
    records = _selected(task_set, args.instances)
    images = list(dict.fromkeys(r.image for r in records if r.image))
    bare = sum(1 for r in records if not r.image)
    console.print(f"{len(images)} distinct image(s) for {len(records)} instance(s) of {task_set.name}"
                  + (f"; {bare} instance(s) name no image (local runtime: nothing to pull)" if bare else ""),
                  markup=False, highlight=False)
    return 1 if pull_all(images, console, jobs=args.jobs) else 0


def cmd_list(args) -> int:
    from rich.table import Table

    from app.cli.report import make_console
    from app.tasksets import NAMED_SETS, load_task_set

    console = make_console()
    if not args.task_set:
        table = Table(title="named task sets (or give a path: a JSONL/JSON/parquet file or folder)")
        for col in ("name", "file", "here"):
            table.add_column(col, overflow="fold")
        for name, path in NAMED_SETS.items():
            table.add_row(name, str(path), "yes" if path.exists() else "no (not on this machine)")
        console.print(table)
        return 0
    task_set = load_task_set(args.task_set)
    table = Table(title=f"task set {task_set.name}: {len(task_set.instances)} instance(s) ({task_set.path})")
    for col in ("instance", "repo", "FAIL_TO_PASS", "PASS_TO_PASS", "image", "difficulty"):
        table.add_column(col, overflow="fold")
    for r in task_set.instances:
        table.add_row(r.instance_id, r.repo, str(len(r.FAIL_TO_PASS)), str(len(r.PASS_TO_PASS)), r.image or "-",
                      r.difficulty or "-")
    console.print(table)
    if task_set.formats:
        console.print(f"formats: {', '.join(f'{k} {v}' for k, v in task_set.formats.items())}", markup=False)
    for warning in task_set.warnings:
        console.print(f"warning: {warning}", markup=False, highlight=False)
    return 0


def register(sub) -> None:
    p = sub.add_parser("tasks", help="task set commands")
    tsub = p.add_subparsers(dest="tasks_command", required=True)
    ls = tsub.add_parser("list", help="the named task sets, or the instances of one (id, repo, tests, image)")
    ls.add_argument("task_set", metavar="SET", nargs="?", help="a named task set (synthetic, starter) or a path")
    ls.set_defaults(handler=cmd_list)
    v = tsub.add_parser("validate", help="grade every instance's gold patch and an empty patch; list instances that "
                                         "cannot be solved or that an empty patch solves (exit 1 if any)")
    v.add_argument("task_set", metavar="SET", help="a named task set (synthetic, swebench-real) or a path")
    v.add_argument("--instances", help="comma-separated instance ids (default: all)")
    v.add_argument("--jobs", type=pulls.positive, default=2, help="grades run at once (default 2)")
    v.add_argument("--timeout", type=pulls.positive, default=1800, help="seconds allowed for one grade's tests (default 1800)")
    v.set_defaults(handler=cmd_validate)
    pf = tsub.add_parser("prefetch", help="pull every image the set's instances name into this node's image cache "
                                          "(exit 1 if any failed)")
    pf.add_argument("task_set", metavar="SET", help="a named task set or a path")
    pf.add_argument("--instances", help="comma-separated instance ids (default: all)")
    pf.add_argument("--jobs", type=pulls.positive, default=2, help="images pulled at once (default 2)")
    pf.set_defaults(handler=cmd_prefetch)
