"""`app.cli.report`: what the CLI prints about a run and a comparison (rendered to text, no server)."""
from __future__ import annotations

from rich.console import Console

from app.cli.report import comparison_table, render_summary, solved_of
from app.stats import compare_samples


def _text(renderable=None, run=None) -> str:
    console = Console(record=True, width=200)
    if run is not None:
        render_summary(run, console)
    else:
        console.print(renderable)
    return console.export_text()


def test_solved_reads_the_summary_field_and_the_old_pass_at_k_key_of_older_runs():
    assert solved_of({"solved": {"a": True, "b": False}}) == {"a": True, "b": False}
    assert solved_of({"pass_at_k": {"a": False}}) == {"a": False}  # a summary stored before the rename
    assert solved_of({"solved": {}, "pass_at_k": {"a": True}}) == {}  # the new key wins, even when empty
    assert solved_of(None) == {} and solved_of({}) == {}


def test_an_eval_summary_lists_the_instances_solved_under_either_key():
    for key in ("solved", "pass_at_k"):
        run = {"id": 3, "kind": "eval", "status": "completed",
               "config": {"harness": "h", "model": {"name": "m"}, "group_size": 4},
               "summary": {key: {"inst-a": True, "inst-b": False}}}
        text = _text(run=run)
        assert "instances solved (4 samples each)" in text
        assert any("inst-a" in line and "yes" in line for line in text.splitlines())
        assert any("inst-b" in line and "no" in line for line in text.splitlines())


def test_comparison_table_shows_pass_at_1_intervals_and_wilson_of_the_pooled_samples():
    before, after = {"a": [False, False], "b": [False, True]}, {"a": [True, False], "b": [True, True]}
    result = compare_samples(before, after, replicates=200, seed=0)
    runs = [{"id": i, "config": {"model": {"name": "m"}}} for i in (1, 2)]
    text = _text(comparison_table(*runs, before, after, result))
    assert "held-out pass@1: run 1 (before) vs run 2 (after)" in text
    assert f"{result.before}" in text and f"{result.difference}" in text
    assert "1/4 [0.046, 0.699]" in text and "3/4 [0.301, 0.954]" in text  # Wilson 95% of 1 and 3 of 4


def test_train_summary_splits_each_step_s_tokens_by_lag_and_marks_steps_without_one():
    steps = [{"step": 1, "policy_version": 1, "metrics": {"off_policy": {"tokens_lag0": 120, "tokens_lag1": 30,
                                                                         "tokens_lag2plus": 4}}},
             {"step": 2, "policy_version": 2, "metrics": {"loss": 0.1}}]  # a step stored before the split
    run = {"id": 5, "kind": "train", "status": "completed", "config": {"harness": "h", "model": {"name": "m"}},
           "summary": {"steps": steps}}
    lines = _text(run=run).splitlines()
    assert any("lag 0/1/2+" in line for line in lines)
    row1 = next(line for line in lines if line.lstrip("│ ").startswith("1 "))
    row2 = next(line for line in lines if line.lstrip("│ ").startswith("2 "))
    assert "120/30/4" in row1
    assert "120/30/4" not in row2 and " - " in row2
