"""Real runs: each of the seven real CLIs, headless, against the real gateway (gunicorn subprocess)
backed by the conformance scripted engine (answering the preset's check script).

Per harness: exit 0, at least one Completion row with prompt ids, sampled ids and
logprobs, the API recorded equals the preset's `api`, the scripted file edit is in
`git diff`, no session token appears in any record, merge fidelity is at least 0.95, and the preset's recorded
`min_prompt_tokens` matches the SmolLM2 token count of its first agent call.  A harness whose CLI is not
installed is skipped with the install command as the reason.
"""
from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from app.conformance.harness_check import run_check
from app.harnesses import get_preset
from app.harnesses.base import CHECK_CONTENT, CHECK_FILE
from app.tables import Completion, Episode
from app.proxy.sessions import TOKEN_PREFIX
from app.runconfig import HARNESSES

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", HARNESSES)
def test_real_cli_through_gateway(name, tmp_path):
    preset = get_preset(name)
    if not preset.is_installed():
        pytest.skip(f"{name} CLI not installed here: `python -m app harness install {name}`")
    # 180 s: a Node CLI can take a minute just to exit on a loaded 2-core box (opencode did, after its last
    # answer, while make learn ran beside the suite); a healthy run takes seconds either way.
    report = run_check(name, timeout_s=180, workdir=tmp_path)
    assert report.exit_code == 0 and not report.timed_out, report.log_tail
    assert report.ok, (report.problems, report.log_tail)

    engine = create_engine(f"sqlite:///{tmp_path / 'check.db'}")
    try:
        with Session(engine) as s:
            rows = list(s.execute(select(Completion).order_by(Completion.seq)).scalars())
            episode = s.execute(select(Episode)).scalar_one()
            assert rows, "no completion recorded"
            for row in rows:
                assert row.episode_id == episode.id
                assert row.api == preset.api
                assert row.prompt_ids and row.sampled_ids
                assert row.logprobs is not None and len(row.logprobs) == len(row.sampled_ids)
                assert all(lp <= 0 for lp in row.logprobs)
                record_text = json.dumps([row.raw_request, row.normalized_request, row.response, row.error])
                assert TOKEN_PREFIX not in record_text  # the session token (tsk-...) is never stored
            assert len(episode.session_token_hash) == 64  # stored hashed only
    finally:
        engine.dispose()

    # The edit the scripted tool call made, seen by `git diff` against the base commit.
    assert f"b/{CHECK_FILE}" in report.patch and f"+{CHECK_CONTENT}" in report.patch
    assert (tmp_path / "workspace" / CHECK_FILE).read_text().strip() == CHECK_CONTENT
    assert report.completions == len(rows) >= 2  # the tool-call turn and the turn after its result
    # Five tool calls with re-serializable arguments: every call that continues the conversation
    # extends its chain token for token (the gateway splices the sampled ids of earlier turns).
    assert report.merge["continuing"] >= 5 and report.merge["fidelity"] >= 0.95, report.merge

    # The preset's recorded minimum prompt (what the API refuses a run by) is what the check
    # measures now: never above it (a harness that fits must never be refused) and within 10%.
    measured, recorded = report.first_prompt_tokens, preset.min_prompt_tokens
    assert measured and recorded, (measured, recorded)
    assert 0.9 * measured <= recorded <= measured, (
        f"{name}: min_prompt_tokens = {recorded} but the check measures {measured}; re-measure and update "
        f"app/harnesses/{name.replace('-', '_')}.py")


@pytest.mark.parametrize("name", HARNESSES)
def test_context_overflow_ends_the_cli_instead_of_hanging(name, tmp_path):
    """A prompt larger than the engine's window gets the engine's 400 in the CLI's own API; the CLI
    must end by itself (exit code aside: Pi answers an overflow by compacting and exits 0)."""
    preset = get_preset(name)
    if not preset.is_installed():
        pytest.skip(f"{name} CLI not installed here: `python -m app harness install {name}`")
    report = run_check(name, timeout_s=60, workdir=tmp_path, max_model_len=2000)
    assert not report.timed_out, report.log_tail
    assert f"+{CHECK_CONTENT}" not in report.patch  # no reply ever carried the scripted edit
    assert all(n < 2000 for n in report.prompt_tokens)  # only calls that fit were answered and recorded
