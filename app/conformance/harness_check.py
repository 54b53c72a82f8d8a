"""`harness check`: one real harness CLI run against the real gateway backed by a scripted engine.

`run_check(name)` starts two subprocesses (`app.conformance.servers.Servers`), the
scripted engine (`app.conformance.scripted.check`, answering the preset's
`check_script()`) and the gateway (gunicorn, `app.proxy:create_gateway_app()`),
both on free loopback ports and bound to one SQL database; it creates a run,
an instance and a `running` episode, issues the episode's session token, writes
the preset's config into a scratch HOME, runs the CLI headless (stdin =
/dev/null) in a fresh one-commit git repository, and reads back what the
gateway recorded.  The report holds: exit status, completions captured (with
prompt ids, sampled ids and logprobs), the APIs spoken, merge fidelity (the
`prefix_merging` builder of `app.training.trajectories` over the captured ids),
the agent's `git diff`, whether the session token leaked into any record, how many calls
the gateway spliced from sampled ids (`app.proxy.splice`), and
`first_prompt_tokens`: the harness's minimum prompt in SmolLM2 tokens (its first
agent call rendered as the embedded engine renders it; see `first_prompt_tokens`).

The full path (a `collect` run through the REST API and a real Celery worker,
where the pipeline's rollout stage runs the same preset) is
`app.conformance.pipeline_check`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from app.conformance.servers import Servers
from app.harnesses import get_preset
from app.harnesses.base import CHECK_CONTENT, CHECK_FILE, CHECK_PROBLEM, HarnessPreset
from app.tables import Base, Completion, Episode, Run, TaskInstance
from app.proxy.sessions import issue_session
from app.runconfig import Budget
from app.runtimes.patch import patch_from_workspace
from app.training.trajectories import CompletionRecord, prefix_merging

CHECK_MODEL = "turnstile-check"


@dataclass
class CheckReport:
    """Outcome of one `harness check` (JSON-able with `asdict`).

    `prompt_tokens` counts the scripted engine's tokens (one per byte); `first_prompt_tokens`
    counts SmolLM2 tokens of the first agent call (None when no call was captured).
    `ok` is True when the CLI exited 0, at least one completion carries prompt ids,
    sampled ids and logprobs of equal length, every completion's API equals the
    preset's `api`, the scripted edit is in the diff and the token is in no record.
    """

    harness: str
    version: str
    api_expected: str
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    completions: int = 0
    completions_with_ids: int = 0
    apis: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    sampled_tokens: list[int] = field(default_factory=list)
    merge: dict = field(default_factory=dict)
    patch: str = ""
    token_leaked: bool = False
    first_prompt_tokens: int | None = None
    problems: list[str] = field(default_factory=list)
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def make_workspace(path: Path) -> None:
    """A one-commit git repository (the 'task' every check edits)."""
    path.mkdir(parents=True)
    (path / "README.md").write_text("# check\n\nA tiny repository for `python -m app harness check`.\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost"}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True)


def create_episode(session: Session, harness: str, splice_history: bool = True) -> int:
    """A collect run, one instance and one `running` episode for the check; returns the episode id."""
    run = Run(kind="collect", status="running", config={"kind": "collect", "harness": harness, "check": True,
                                                        "splice_history": splice_history})
    inst = TaskInstance(task_set="harness-check", instance_id=f"check-{harness}", repo="local/check",
                        record={"problem_statement": CHECK_PROBLEM})
    session.add_all([run, inst])
    session.flush()
    ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0, status="running")
    session.add(ep)
    session.flush()
    return ep.id


def first_agent_call(preset: HarnessPreset, rows: list[Completion]) -> Completion | None:
    """The first captured call that offers the preset's edit tool (the agent loop's first turn).

    Auxiliary calls (a title generator, a router, a memory agent) come without the agent's
    tools and are skipped: the agent cannot work unless its own first turn fits.  Falls back
    to the first call when none offers the tool (a harness that edits without tools).
    """
    wanted = next((t.tool for t in preset.check_script() if t.tool), None)
    for row in rows:
        body = row.normalized_request or {}
        names = {(t.get("function") or {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
        if wanted is not None and wanted in names:
            return row
    return rows[0] if rows else None


def first_prompt_tokens(preset: HarnessPreset, rows: list[Completion]) -> int | None:
    """The harness's minimum prompt: SmolLM2 tokens of its first agent call, or None without calls.

    The call's normalized (Chat Completions) request is rendered exactly as the embedded
    engine renders it (`app.engines.embedded.templates.render_prompt` with SmolLM2's tokenizer from
    `app.engines.modeling.load_tokenizer`, generation prompt included), so the count is the
    prompt length the engine would check against its context window.  The check's own
    problem statement is one line, so the count is the harness's fixed overhead (system
    prompt, tool schemas, environment context).  Raises `TemplateError` when the request
    cannot be rendered.
    """
    row = first_agent_call(preset, rows)
    if row is None or not row.normalized_request:
        return None
    from app.engines.modeling import load_tokenizer
    from app.engines.embedded.templates import render_prompt

    body = row.normalized_request
    ids = render_prompt(load_tokenizer(), body.get("messages"), body.get("tools"),
                        bool(body.get("add_generation_prompt", True)), body.get("chat_template_kwargs") or {})
    return len(ids)


def continues_conversation(row: Completion) -> bool:
    """Whether the call's request holds an earlier assistant turn (a call that should extend a
    chain), unlike the first call of an agent, a sub-agent or an auxiliary prompt (a title
    generator), which starts a conversation of its own."""
    messages = (row.normalized_request or {}).get("messages") or []
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


def merge_fidelity(rows: list[Completion], sequences) -> dict:
    """`fidelity`: of the calls that continue a conversation (`continues_conversation`), the
    share that extended a chain token-exactly (None without such calls); `continuing`: how many
    there were.  A call that begins a new conversation (an auxiliary prompt) starts a chain of
    its own and is not counted as a failed merge."""
    starters = {seq.completions[0] for seq in sequences if seq.completions}
    merged = {label for seq in sequences for label in seq.completions[1:]}
    continuing = [r.id for r in rows if continues_conversation(r) and (r.id in merged or r.id in starters)]
    hits = sum(1 for cid in continuing if cid in merged)
    return {"fidelity": round(hits / len(continuing), 3) if continuing else None, "continuing": len(continuing)}


def evaluate(report: CheckReport, preset: HarnessPreset, rows: list[Completion], patch: str, token: str) -> None:
    """Fill the record-derived fields of `report` and its list of problems."""
    report.completions = len(rows)
    report.apis = sorted({r.api for r in rows})
    report.prompt_tokens = [len(r.prompt_ids or []) for r in rows]
    report.sampled_tokens = [len(r.sampled_ids or []) for r in rows]
    report.completions_with_ids = sum(
        1 for r in rows if r.prompt_ids and r.sampled_ids and r.logprobs is not None
        and len(r.logprobs) == len(r.sampled_ids))
    records = [CompletionRecord(seq=r.seq, prompt_ids=r.prompt_ids, sampled_ids=r.sampled_ids, logprobs=r.logprobs,
                                finish_reason=r.finish_reason, completion_id=r.id) for r in rows]
    built = prefix_merging(records)
    rep = built.report
    report.merge = {k: rep[k] for k in ("completions", "accepted", "rejected", "chains", "completions_merged",
                                        "chains_cut", "cut_reasons")}
    report.merge.update(merge_fidelity(rows, built.sequences))
    report.merge["spliced"] = sum(1 for r in rows if "completion" in ((r.raw_request or {}).get("splice") or {}))
    report.patch = patch
    report.first_prompt_tokens = first_prompt_tokens(preset, rows)
    blob = json.dumps([[r.raw_request, r.normalized_request, r.response, r.error] for r in rows], default=str)
    report.token_leaked = token in blob
    p = report.problems
    if report.timed_out:
        p.append("the CLI did not finish within the time limit")
    elif report.exit_code != 0:
        p.append(f"the CLI exited {report.exit_code}")
    if report.completions_with_ids == 0:
        p.append("no completion with prompt ids, sampled ids and logprobs was captured")
    if report.apis and report.apis != [preset.api]:
        p.append(f"API spoken {report.apis} != preset api {preset.api!r}")
    if f"+{CHECK_CONTENT}" not in patch or CHECK_FILE not in patch:
        p.append(f"the scripted edit of {CHECK_FILE} is not in git diff")
    if report.token_leaked:
        p.append("the session token appears in a completion record")


def run_check(name: str, *, timeout_s: float = 120.0, workdir: Path | None = None,
              budget: Budget | None = None, max_model_len: int | None = None,
              splice_history: bool = True) -> CheckReport:
    """Run harness `name` once against a fresh gateway + scripted engine; returns a `CheckReport`.

    Uses its own SQLite database under `workdir` (a temporary folder by default,
    removed afterwards unless given).  `max_model_len` shrinks the scripted engine's
    context window (token = byte there) to provoke context-overflow errors;
    `splice_history=False` makes the gateway render every turn from the harness's text (the
    run option of the same name).  Raises
    `HarnessInstallError` when the CLI is not installed, RuntimeError when a server does
    not start, ValueError for an unknown harness or a non-empty `workdir`.
    """
    preset = get_preset(name)
    preset.require_installed()
    budget = budget or Budget(max_turns=8, max_tokens=512)
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix=f"turnstile-check-{name}-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise ValueError(f"workdir {work} must be empty (each check uses a fresh database and workspace)")
    report = CheckReport(harness=name, version=preset.version, api_expected=preset.api)
    url = f"sqlite:///{work / 'check.db'}"
    engine = create_engine(url)
    try:
        Base.metadata.create_all(engine)
        with Session(engine) as s, s.begin():
            episode_id = create_episode(s, name, splice_history)
            token = issue_session(s, episode_id)
        workspace, home = work / "workspace", work / "home"
        make_workspace(workspace)
        home.mkdir()
        with Servers(name, url, work, max_model_len) as servers:
            preset.write_config(home, servers.gateway_url, token, CHECK_MODEL, budget)
            env = preset.env(home, servers.gateway_url, token, CHECK_MODEL)
            env["PATH"] = os.pathsep.join([*preset.path_prepend(), os.environ.get("PATH", "/usr/bin:/bin")])
            for var in ("LANG", "TMPDIR"):
                if var in os.environ:
                    env.setdefault(var, os.environ[var])
            t0 = time.monotonic()
            try:
                proc = subprocess.run(preset.command(CHECK_PROBLEM, budget), cwd=workspace, env=env,
                                      stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
                                      start_new_session=True)
                report.exit_code = proc.returncode
                out = (proc.stdout + proc.stderr).decode(errors="replace")
            except subprocess.TimeoutExpired as exc:
                report.timed_out = True
                out = ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")
            report.seconds = round(time.monotonic() - t0, 2)
            report.log_tail = out[-3000:].replace(token, "<session-token>")
        with Session(engine) as s:
            rows = list(s.execute(select(Completion).where(Completion.episode_id == episode_id)
                                  .order_by(Completion.seq)).scalars())
            s.expunge_all()
        evaluate(report, preset, rows, patch_from_workspace(workspace), token)
        return report
    finally:
        engine.dispose()
        if own:
            shutil.rmtree(work, ignore_errors=True)
