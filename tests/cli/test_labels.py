"""`turnstile submit --name/--tag/--notes`, `turnstile label` and `turnstile runs --search/--tag`
against the real API app (over WSGI) and a real database; bad input exits 2 with the reason."""
from __future__ import annotations

import json


from app.cli import main
from app.db import session_scope
from app.tables import Run

REDIS_DB = 10


def _labels(run_id: int) -> tuple:
    with session_scope() as s:
        run = s.get(Run, run_id)
        return run.name, run.tags, run.notes


def test_submit_with_labels_then_label_then_search(api, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the runs table on one line per run
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"kind": "eval", "simulate": {"episode_median_s": 0.1}, "name": "from the file",
                                "tags": ["file-tag"]}))
    assert main(["submit", "--config", str(path), "--name", "baseline", "--tag", "Smol", "--notes", "demo settings"]) == 0
    with session_scope() as s:
        run_id = s.query(Run.id).scalar()
    assert _labels(run_id) == ("baseline", ["file-tag", "smol"], "demo settings")  # --name wins, --tag adds
    assert main(["submit", "--set", "kind=eval", "--set", "simulate.episode_median_s=0.1"]) == 0
    capsys.readouterr()

    assert main(["label", str(run_id), "--tag", "keep", "--untag", "file-tag", "--notes", ""]) == 0
    assert capsys.readouterr().out.startswith(f"run {run_id}: baseline [keep, smol]")
    assert _labels(run_id) == ("baseline", ["keep", "smol"], None)

    assert main(["runs", "--search", "BASE"]) == 0
    out = capsys.readouterr().out
    assert "baseline [keep, smol]" in out and out.count("eval") == 1, out  # the other run is not listed
    assert main(["runs", "--tag", "keep", "--tag", "smol", "--kind", "eval"]) == 0
    assert "baseline" in capsys.readouterr().out
    assert main(["runs", "--tag", "absent"]) == 0
    assert "baseline" not in capsys.readouterr().out


def test_bad_labels_exit_2_with_the_reason_and_change_nothing(api, capsys):
    assert main(["submit", "--set", "kind=eval", "--set", "simulate.episode_median_s=0.1", "--tag", "no spaces"]) == 2
    assert "tags.0" in capsys.readouterr().err
    with session_scope() as s:
        assert s.query(Run).count() == 0  # refused at the check, before anything (a warm start) ran
    assert main(["submit", "--set", "kind=eval", "--set", "simulate.episode_median_s=0.1", "--name", "kept"]) == 0
    with session_scope() as s:
        run_id = s.query(Run.id).scalar()
    capsys.readouterr()
    assert main(["label", str(run_id), "--tag", "Not Ok"]) == 2
    assert "add_tags.0" in capsys.readouterr().err
    assert main(["label", str(run_id)]) == 2
    assert "nothing was changed" in capsys.readouterr().err
    assert main(["runs", "--tag", "Not Ok"]) == 2
    assert "tag:" in capsys.readouterr().err
    assert _labels(run_id) == ("kept", None, None)
