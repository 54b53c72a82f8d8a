"""The end-of-run summary printed by `submit --follow`, `follow` and the demo."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def make_console() -> Console:
    """The CLI's rich Console: a terminal's own width.  Written to a pipe or a log (`make learn >
    log`, CI) rich assumes 80 columns and cuts table cells to "0.5…"; there it is wide enough that
    no cell is cut (tables still size to their content)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=400)
    return console


def _fmt(value, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def render_summary(run: dict, console: Console) -> None:
    summary = run.get("summary") or {}
    console.print(f"\n[bold]Run {run['id']}[/bold] ({run['kind']}, harness {run['config'].get('harness')}, "
                  f"model {run['config'].get('model', {}).get('name')}) finished: [bold]{run['status']}[/bold]")
    if run.get("error"):
        console.print(f"error: {run['error']}")
    if summary.get("steps"):
        table = Table(title="training steps")
        # With dynamic sampling, groups of equal rewards were set aside: show how many, and the
        # reward over every drawn episode beside the trained ones' (which are mixed by construction).
        filtering = any(st.get("groups_filtered") for st in summary["steps"])
        for col in ("step", "ver", "eps", "reward", *(("filtered", "drawn reward") if filtering else ()),
                    "resolved", "loss", "lp gap", "tokens", "train s"):
            table.add_column(col)
        for st in summary["steps"]:
            m = st.get("metrics") or {}
            drawn = (_fmt(st.get("groups_filtered")), _fmt(st.get("sampled_reward_mean"))) if filtering else ()
            table.add_row(str(st["step"]), _fmt(st.get("policy_version")), _fmt(st.get("episodes")),
                          _fmt(st.get("reward_mean")), *drawn, _fmt(st.get("resolved_rate")), _fmt(m.get("loss"), ".4f"),
                          _fmt(m.get("logprob_gap_max_abs"), ".1e"), _fmt(m.get("tokens_trained")), _fmt(st.get("train_s"), ".1f"))
        console.print(table)
    if summary.get("pass_at_k") and run["kind"] != "train":
        table = Table(title=f"pass@{run['config'].get('group_size')} per instance")
        table.add_column("instance")
        table.add_column("resolved by any sample")
        for name, ok in summary["pass_at_k"].items():
            table.add_row(name, "yes" if ok else "no")
        console.print(table)
    facts = Table(show_header=False, title="totals")
    facts.add_column("what")
    facts.add_column("value")
    facts.add_row("episodes", ", ".join(f"{k}: {v}" for k, v in sorted((summary.get("episodes_by_status") or {}).items())))
    if summary.get("episodes_harness_failed"):
        facts.add_row("harness failures", f"{summary['episodes_harness_failed']} episodes failed before any usable "
                                          "model call (not graded, not trained on)")
    facts.add_row("reward mean / resolved rate", f"{_fmt(summary.get('reward_mean'))} / {_fmt(summary.get('resolved_rate'))}")
    facts.add_row("completions captured", f"{summary.get('completions', 0)} (partial {summary.get('partial_completions', 0)}, "
                                          f"rejected {summary.get('rejected_completions', 0)})")
    merge = summary.get("merge") or {}
    if merge:
        facts.add_row("prefix merging", f"{merge.get('completions', 0)} completions -> {merge.get('chains', 0)} chains "
                                        f"({merge.get('merged', 0)} merged, {merge.get('cut', 0)} cut, {merge.get('rejected', 0)} rejected)")
    if summary.get("logprob_gap_max_abs") is not None:
        facts.add_row("trainer vs rollout logprob gap", f"max |Δ| {summary['logprob_gap_max_abs']:.2e} nats")
    stages = summary.get("stage_seconds") or {}
    facts.add_row("stage seconds (p50)", f"prepare {_fmt(stages.get('prepare_p50'), '.1f')}, rollout {_fmt(stages.get('rollout_p50'), '.1f')}"
                                         f" (p99 {_fmt(stages.get('rollout_p99'), '.1f')}), grade {_fmt(stages.get('grade_p50'), '.1f')}")
    if summary.get("trainer_busy_fraction") is not None:
        facts.add_row("trainer busy fraction", _fmt(summary["trainer_busy_fraction"]))
    if summary.get("groups_by_status"):
        facts.add_row("groups", ", ".join(f"{k}: {v}" for k, v in sorted(summary["groups_by_status"].items())))
    if summary.get("checkpoint"):
        facts.add_row("last checkpoint", summary["checkpoint"])
    if summary.get("export_path"):
        facts.add_row("exported trajectories", summary["export_path"])
    console.print(facts)
