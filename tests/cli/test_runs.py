"""`python -m app` run commands against the real API app (over WSGI) and a real database."""
from __future__ import annotations

import datetime as dt

import pytest

from app.cli import main
from app.cli import client as cli_client
from app.cli import runs as runs_cli
from app.db import session_scope
from app.tables import Episode, Run, TaskInstance

REDIS_DB = 10


def _run(status: str = "completed", rewards=(1.0, 0.0, 1.0, 1.0), age_s: float = 90.0,
         running_s: float | None = None) -> int:
    with session_scope() as s:
        inst = TaskInstance(task_set="synthetic", instance_id="calc-add", repo="r", record={})
        s.add(inst)
        created = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=age_s)
        started = None if running_s is None else dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=running_s)
        run = Run(kind="eval", status=status, created_at=created, started_at=started,
                  config={"kind": "eval", "harness": "mini-swe-agent", "task_set": "a-very-long-task-set-name/" + "x" * 60,
                          "group_size": 4, "steps": 1, "model": {"name": "smollm2"}})
        s.add(run)
        s.flush()
        for k, reward in enumerate(rewards):
            s.add(Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=k, status="completed",
                          reward=reward, resolved=reward == 1.0))
        return run.id


def test_set_splits_list_options_on_commas():
    config: dict = {}
    runs_cli._set(config, "instances", "a,b")
    runs_cli._set(config, "model.engine_urls", "http://x:1,http://y:2")
    runs_cli._set(config, "group_size", "4")
    runs_cli._set(config, "harness", "mini-swe-agent")
    assert config == {"instances": ["a", "b"], "model": {"engine_urls": ["http://x:1", "http://y:2"]},
                      "group_size": 4, "harness": "mini-swe-agent"}
    single: dict = {}
    runs_cli._set(single, "instances", "only-one")
    runs_cli._set(single, "model.name", "a,b")  # not a list option: kept as typed
    assert single == {"instances": ["only-one"], "model": {"name": "a,b"}}


def test_submit_reports_every_validation_error_at_once(api, capsys):
    assert main(["submit", "--set", "group_size=four", "--set", "timeouts.agent_s=0", "--set", "mode=turbo"]) == 2
    message = capsys.readouterr().err
    assert "3 problems" in message
    for field in ("group_size:", "timeouts.agent_s:", "mode:"):
        assert f"\n  {field}" in message, message
    with session_scope() as s:
        assert s.query(Run).count() == 0


def test_runs_shows_reward_and_resolved_without_truncating_when_piped(api, capsys):
    run_id = _run()
    assert main(["runs"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip("│ ").startswith(str(run_id)))
    assert "0.750" in row and "75%" in row
    assert "a-very-long-task-set-name/" + "x" * 60 in row  # the whole cell, on one line


def test_follow_prints_progress_lines_when_not_a_terminal_with_the_time_running(api, capsys, monkeypatch):
    run_id = _run(status="running", age_s=600, running_s=45)  # queued 555 s, then running for 45 s
    polls = []

    def finish(_seconds):
        polls.append(1)
        if len(polls) == 2:
            with session_scope() as s:
                s.get(Run, run_id).status = "completed"

    monkeypatch.setattr(cli_client.time, "sleep", finish)
    assert main(["follow", str(run_id)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"run {run_id} ")]
    assert len(lines) == 2, lines  # printed on change only: running (twice polled), then completed
    assert lines[0].startswith(f"run {run_id} running; episodes completed 4") and "reward 0.750 over 4" in lines[0]
    elapsed = int(lines[0].rsplit("elapsed ", 1)[1].split()[0])
    # since it started running (45 s before): not its age (600 s and more), nor since following began (0)
    assert 45 <= elapsed < 600
    assert lines[1].startswith(f"run {run_id} completed")


def test_ctrl_c_in_follow_says_the_run_continues(api, capsys, monkeypatch):
    run_id = _run(status="running")

    def interrupt(_seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_client.time, "sleep", interrupt)
    assert main(["follow", str(run_id)]) == 130
    err = capsys.readouterr().err
    assert f"run {run_id} continues" in err
    assert f"turnstile follow {run_id}" in err and f"turnstile cancel {run_id}" in err
    with session_scope() as s:
        assert s.get(Run, run_id).status == "running"


def test_export_of_a_missing_run_is_one_line(api, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["export", "999", "-o", str(tmp_path / "out.jsonl")])
    assert str(exc.value) == "error: export of run 999: 404 run 999 not found"
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("name, text", [
    ("run.json", '{"kind": "eval", "group_size": 3, "simulate": {"episode_median_s": 0.1}}'),
    ("run.yaml", "kind: eval\ngroup_size: 3\nsimulate:\n  episode_median_s: 0.1\n"),
    ("run.toml", 'kind = "eval"\ngroup_size = 3\n[simulate]\nepisode_median_s = 0.1\n'),
])
def test_submit_reads_json_yaml_and_toml_configs(api, tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert main(["submit", "--config", str(path)]) == 0
    with session_scope() as s:
        run = s.query(Run).one()
        assert run.config["group_size"] == 3 and run.config["simulate"]["episode_median_s"] == 0.1


@pytest.mark.parametrize("name, text", [("bad.yaml", "kind: [eval\n"), ("bad.toml", "kind = \n"),
                                        ("bad.json", "{kind"), ("list.yaml", "- 1\n- 2\n")])
def test_a_config_file_that_does_not_parse_is_named(api, tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert main(["submit", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(path) in err and len(err.splitlines()) == 1


def test_the_run_summary_shows_filtered_groups_and_the_drawn_reward_only_when_dynamic_sampling_acted():
    from rich.console import Console

    from app.cli.report import render_summary

    step = {"step": 0, "policy_version": 1, "episodes": 4, "reward_mean": 0.5, "resolved_rate": 0.5,
            "groups_filtered": 3, "sampled_reward_mean": 0.125, "metrics": {"loss": -0.0123}}
    run = {"id": 1, "kind": "train", "status": "completed", "config": {"harness": "h", "model": {"name": "m"}},
           "summary": {"steps": [step]}}
    console = Console(record=True, width=200)
    render_summary(run, console)
    text = console.export_text()
    assert "drawn reward" in text and "0.125" in text and "-0.0123" in text
    console = Console(record=True, width=200)
    render_summary({**run, "summary": {"steps": [{**step, "groups_filtered": 0}]}}, console)
    assert "drawn reward" not in console.export_text()
