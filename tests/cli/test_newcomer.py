"""The newcomer's path through `turnstile`: usage instead of a run, every problem of a config at once
(with the value received and a "did you mean"), a run no worker takes, show, tasks list, timeouts.

Against the real API app (over WSGI), a real database and a real Redis; the timeout test against a
real socket that accepts and never answers.
"""
from __future__ import annotations

import datetime as dt
import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from app.cli import build_parser, main
from app.cli import client as cli_client
from app.db import session_scope
from app.tables import Run, utcnow
from support import AUTH, ROOT

REDIS_DB = 10


def _runs() -> int:
    with session_scope() as s:
        return s.query(Run).count()


def test_bare_submit_prints_usage_and_submits_nothing(api, capsys):
    assert main(["submit"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: turnstile submit") and "nothing was submitted" in err
    assert "--config demo/train.json" in err  # a config that can learn, as the first example
    assert _runs() == 0


def test_the_program_is_named_turnstile_also_as_python_m_app(capsys):
    assert build_parser().prog == "turnstile"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: turnstile ")
    out = subprocess.run([sys.executable, "-m", "app", "submit", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: turnstile submit"), out.stderr[-2000:]


def test_submit_names_every_problem_with_its_value_and_a_did_you_mean(api, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    # PyYAML (YAML 1.1) reads 1e-5 as the string "1e-5"; `taks_set` is a typo of task_set
    path.write_text("kind: train\ntaks_set: starter\ngroup_size: 4\ntraining:\n  learning_rate: 1e-5\n"
                    "model:\n  name: gpt-4o\n")
    assert main(["submit", "--config", str(path), "--set", "task_set=no-such-set"]) == 2
    message = capsys.readouterr().err
    lines = {line.split(": ", 1)[0].strip(): line.split(": ", 1)[1] for line in message.splitlines()[1:]}
    assert message.startswith("run rejected: 4 problems"), message
    assert "did you mean 'task_set'" in lines["taks_set"] and "'starter'" in lines["taks_set"]
    assert "got '1e-5' (a string)" in lines["training.learning_rate"]
    assert "write 1.0e-5" in lines["training.learning_rate"]
    # installation checks in the same answer, though the schema failed: task set and model together
    assert "no-such-set" in lines["task_set"]
    assert "'gpt-4o'" in lines["model.name"] and "vllm" in lines["model.name"]
    assert _runs() == 0


def test_installation_problems_come_together_over_the_api(api):
    with api.test_client() as c:
        resp = c.post("/api/runs", json={"task_set": "no-such-set", "model": {"name": "gpt-4o"}}, headers=AUTH)
    err = resp.get_json()["error"]
    assert resp.status_code == 400 and [d["field"] for d in err["details"]] == ["task_set", "model.name"]
    assert err["message"].startswith("invalid run config: task_set: ")


def _queued(age_s: float, kind: str = "train") -> int:
    with session_scope() as s:
        run = Run(kind=kind, status="queued", created_at=utcnow() - dt.timedelta(seconds=age_s),
                  config={"kind": kind, "harness": "mini-swe-agent", "task_set": "starter", "steps": 2,
                          "model": {"name": "smollm2"}})
        s.add(run)
        s.flush()
        return run.id


def test_follow_and_show_say_when_no_control_worker_took_the_run(api, capsys):
    run_id = _queued(age_s=3600)  # far past a lease plus a watchdog period
    with pytest.raises(SystemExit, match="still queued"):
        cli_client.follow_run(run_id, poll_s=0, timeout_s=0)
    out = capsys.readouterr().out
    assert f"run {run_id} queued" in out and "elapsed not started" in out
    assert "waiting: no control worker has taken this run in 3600 s" in out
    assert main(["show", str(run_id)]) == 0
    out = capsys.readouterr().out
    assert f"run {run_id} train · queued · harness mini-swe-agent" in out
    assert "no control worker has taken this run" in out and f"turnstile cancel {run_id}" in out
    assert f"/runs/{run_id}" in out  # its dashboard page


def test_cancel_of_a_run_that_never_started_completes(api, capsys):
    run_id = _queued(age_s=3600)
    assert main(["cancel", str(run_id)]) == 0
    assert capsys.readouterr().out.strip() == f"run {run_id}: cancelled"
    with session_scope() as s:
        assert s.get(Run, run_id).status == "cancelled"
    assert main(["show", str(run_id)]) == 0
    out = capsys.readouterr().out
    assert "cancelled" in out and "waiting" not in out


def test_show_of_a_finished_run_prints_its_summary(api, capsys):
    with session_scope() as s:
        run = Run(kind="eval", status="completed", created_at=utcnow(), started_at=utcnow(), finished_at=utcnow(),
                  config={"kind": "eval", "harness": "mini-swe-agent", "task_set": "starter", "group_size": 2,
                          "model": {"name": "smollm2"}},
                  summary={"episodes_by_status": {"completed": 2}, "reward_mean": 0.5, "resolved_rate": 0.5,
                           "solved": {"calc-add": True}})
        s.add(run)
        s.flush()
        run_id = run.id
    assert main(["show", str(run_id)]) == 0
    out = capsys.readouterr().out
    assert "finished: completed" in out and "calc-add" in out and "0.500 / 0.500" in out
    assert main(["show", "999"]) == 1
    assert "404 run 999 not found" in capsys.readouterr().err


def test_tasks_list_names_the_sets_and_a_sets_instances(capsys):
    assert main(["tasks", "list"]) == 0
    out = capsys.readouterr().out
    assert "synthetic" in out and "starter" in out
    assert main(["tasks", "list", "synthetic"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (ROOT / "data" / "tasks" / "synthetic.jsonl").read_text().splitlines()
               if line.strip()]
    assert f"task set synthetic: {len(records)} instance(s)" in out
    assert all(r["instance_id"] in out for r in records)
    assert main(["tasks", "list", "no-such-set"]) == 1
    assert "no-such-set" in capsys.readouterr().err


@pytest.fixture
def silent_server():
    """A real TCP server that accepts connections and never answers (an API busy past the timeout)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def test_a_timeout_is_not_reported_as_an_unreachable_api(silent_server, monkeypatch, capsys):
    monkeypatch.setattr(cli_client, "api_client", lambda: httpx.Client(base_url=silent_server, timeout=0.3, headers=AUTH))
    monkeypatch.setattr(cli_client, "EXPORT_READ_TIMEOUT_S", 0.3)
    assert main(["export", "1"]) == 1
    err = capsys.readouterr().err
    assert "took too long to answer GET /api/runs/1/export" in err and "cannot reach" not in err
    assert main(["runs"]) == 1
    err = capsys.readouterr().err
    assert "took too long to answer GET /api/runs" in err and "cannot reach" not in err


def test_an_api_that_is_not_there_is_reported_as_unreachable(monkeypatch, capsys):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setattr(cli_client, "api_client", lambda: httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=2))
    assert main(["runs"]) == 1
    assert "cannot reach the Turnstile API" in capsys.readouterr().err


def test_the_readmes_example_task_record_loads_as_a_task_set(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- example-task-record -->", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    record = json.loads(" ".join(block.split("\n")).replace("<40-hex commit id>", "a" * 40))
    path = tmp_path / "calc.jsonl"
    path.write_text(json.dumps(record) + "\n")
    assert main(["tasks", "list", str(path)]) == 0
    out = capsys.readouterr().out
    assert "calc__add-1" in out and "you/calc" in out
    for field in ("instance_id", "repo", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS"):
        broken = {k: v for k, v in record.items() if k != field}  # every field the README calls required is
        path.write_text(json.dumps(broken) + "\n")
        assert main(["tasks", "list", str(path)]) == 1, field  # ... refused when missing, by name
        assert field in capsys.readouterr().err
