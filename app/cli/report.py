"""What the CLI prints and writes about runs: the end-of-run summary (`submit --follow`, `follow`,
the demo, `learn`) and the held-out comparison (`compare`, `learn`).  Rendering only: the numbers
come from the API and `app.stats`.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Mapping

from rich.console import Console
from rich.table import Table

from app.paths import write_atomic

if TYPE_CHECKING:  # numpy stays unloaded for commands that print no comparison
    from app.stats import Comparison, Samples


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


def solved_of(summary: Mapping | None) -> dict[str, bool]:
    """{instance id: some sample resolved it} of a run summary (API shape); {} when it has none.

    Summaries written before the field was named `solved` call it `pass_at_k`; both are read.
    """
    summary = summary or {}
    found = summary.get("solved")
    return dict(found if found is not None else summary.get("pass_at_k") or {})


def _lag_split(off_policy: Mapping | None) -> str:
    """Trained tokens by how many policy versions their sampling weights lag the trainer's,
    "lag 0 / 1 / 2+" (`CorrectionStats.metrics`' `tokens_lag*`); "-" where the step has none."""
    counts = [(off_policy or {}).get(f"tokens_lag{k}") for k in ("0", "1", "2plus")]
    return "/".join(str(c) for c in counts) if any(c is not None for c in counts) else "-"


def render_summary(run: dict, console: Console) -> None:
    """Print the summary of a finished run (API shape): steps, solved instances, totals."""
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
                    "resolved", "loss", "lp gap", "lp gap older", "tokens", "lag 0/1/2+", "train s"):
            table.add_column(col)
        for st in summary["steps"]:
            m = st.get("metrics") or {}
            drawn = (_fmt(st.get("groups_filtered")), _fmt(st.get("sampled_reward_mean"))) if filtering else ()
            table.add_row(str(st["step"]), _fmt(st.get("policy_version")), _fmt(st.get("episodes")),
                          _fmt(st.get("reward_mean")), *drawn, _fmt(st.get("resolved_rate")), _fmt(m.get("loss"), ".4f"),
                          _fmt(m.get("logprob_gap_max_abs"), ".1e"), _fmt(m.get("logprob_gap_stale_max_abs"), ".1e"),
                          _fmt(m.get("tokens_trained")), _lag_split(m.get("off_policy")), _fmt(st.get("train_s"), ".1f"))
        console.print(table)
    solved = solved_of(summary)
    if solved and run["kind"] != "train":
        table = Table(title=f"instances solved ({run['config'].get('group_size')} samples each)")
        table.add_column("instance")
        table.add_column("resolved by any sample")
        for name, ok in solved.items():
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
        facts.add_row("trainer vs rollout logprob gap (on-policy tokens)", f"max |Δ| {summary['logprob_gap_max_abs']:.2e} nats")
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


def comparison_table(before_run: Mapping, after_run: Mapping, before: Samples, after: Samples, result: Comparison) -> Table:
    """The before/after table: pass@1 per instance, then overall with intervals and the difference."""
    from app.stats import wilson

    def label(run: Mapping) -> str:
        model = run["config"].get("model", {})
        return f"run {run['id']} ({model.get('checkpoint') or model.get('name')})"

    table = Table(title=f"held-out pass@1: run {before_run['id']} (before) vs run {after_run['id']} (after)")
    for col in ("instance", f"before: {label(before_run)}", f"after: {label(after_run)}"):
        table.add_column(col)
    for name in sorted(set(before) | set(after)):
        table.add_row(name, *(f"{sum(d[name])}/{len(d[name])}" if d.get(name) else "-" for d in (before, after)))
    table.add_section()
    table.add_row("pass@1 [95% CI]", str(result.before), str(result.after))
    table.add_row("after - before [95% CI]", "", str(result.difference))
    table.add_row("instances / samples", f"{result.instances} / {result.samples_before}",
                  f"{result.instances} / {result.samples_after}")
    pooled = []
    for d in (before, after):
        flags = [f for name in sorted(set(before) & set(after)) for f in d[name]]
        low, high = wilson(sum(flags), len(flags))
        pooled.append(f"{sum(flags)}/{len(flags)} [{low:.3f}, {high:.3f}]")
    table.add_row("resolved samples [Wilson 95%]", *pooled)
    return table


def write_json(path: str, before_run: Mapping, after_run: Mapping, before: Samples, after: Samples, result: Comparison) -> None:
    """The comparison as JSON (what `learning.png` and the README table are made from)."""
    # atomic: a reader (the figure, the README table) never sees half a file
    write_atomic(path, json.dumps({"before_run": before_run["id"], "after_run": after_run["id"], **result.to_dict(),
                                   "per_instance": {"before": before, "after": after}}, indent=2))
