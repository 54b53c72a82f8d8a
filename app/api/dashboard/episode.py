"""What the episode page shows, read from SQL and the episode's harness logs as plain dicts: the
grading report, the patch as a diff, the harness logs' tails, every model call as a conversation,
and the token view of each trained sequence.  Nothing here renders HTML.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.paths import RunPaths
from app.proxy.apis import REGISTRY
from app.api.dashboard.data import seconds_between
from app.api.dashboard.groups import episode_group
from app.api.tokenizer import decoder_for
from app.api.token_versions import lag_class, trajectory_versions
from app.control.failure import failure_reason
from app.tables import Completion, Episode, TrainingStep, Trajectory

LOG_TAIL_BYTES = 64 * 1024
LOG_TAIL_LINES = 200


def harness_logs(run_id: int, episode_id: int) -> list[dict]:
    """Tails of `<var_dir>/runs/<run>/episodes/<episode>/harness-attempt*.log`, latest attempt first."""
    logs = []
    for attempt, path in RunPaths(run_id).harness_logs(episode_id):
        size = path.stat().st_size
        with open(path, "rb") as fh:
            fh.seek(max(0, size - LOG_TAIL_BYTES))
            text = fh.read().decode("utf-8", errors="replace")
        lines = text.splitlines()
        logs.append({"attempt": attempt, "path": str(path), "size": size,
                     "truncated": size > LOG_TAIL_BYTES or len(lines) > LOG_TAIL_LINES,
                     "tail": "\n".join(lines[-LOG_TAIL_LINES:])})
    return sorted(logs, key=lambda log: str(log["attempt"]).zfill(6), reverse=True)


def grading_tests(report: dict | None) -> list[dict]:
    """FAIL_TO_PASS / PASS_TO_PASS tests with outcomes, from swebench's `tests_status`."""
    rows = []
    for group, outcomes in ((report or {}).get("tests_status") or {}).items():
        for outcome in ("failure", "success"):
            for test in (outcomes or {}).get(outcome) or []:
                rows.append({"group": group, "test": test, "passed": outcome == "success"})
    return rows


def grading_surface(report: dict | None) -> dict:
    """What the grader put back of the patch and what it kept as library code, rule by rule.

    From `report["test_surface"]` ({layout, reverted: {path: {rule, why}}, kept: {path: why}});
    reports written before it have only `reverted_files` {path: reason}, shown with no rule.
    Returns {"rows": [{path, action ("put back" | "kept"), rule, why}], "undecided": the rule's
    words when the test layout could not be decided, else None}."""
    report = report or {}
    surface = report.get("test_surface") or {}
    reverted = surface.get("reverted") or {p: {"rule": "", "why": r} for p, r in (report.get("reverted_files") or {}).items()}
    rows = [{"path": p, "action": "put back", "rule": e.get("rule") or "", "why": e.get("why") or ""}
            for p, e in reverted.items()]
    rows += [{"path": p, "action": "kept", "rule": "library code", "why": why} for p, why in (surface.get("kept") or {}).items()]
    layout = surface.get("layout") or {}
    return {"rows": rows, "undecided": layout.get("rule") if layout and not layout.get("decided") else None}


def diff_lines(patch: str | None) -> list[tuple[str, str]]:
    """(css class, line) for each line of a unified diff."""
    out = []
    for line in (patch or "").splitlines():
        if line.startswith(("+++", "---", "diff ", "index ")):
            kind = "file"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "del"
        else:
            kind = "ctx"
        out.append((kind, line))
    return out


def _content_text(content: Any) -> str:
    """Chat Completions message content (a string or a list of parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _tool_calls(calls: Any) -> list[dict]:
    out = []
    for call in calls or []:
        fn = (call or {}).get("function") or {}
        out.append({"name": fn.get("name") or call.get("name"), "arguments": fn.get("arguments") or call.get("arguments"),
                    "id": call.get("id")})
    return out


def message_view(msg: dict) -> dict:
    """One Chat Completions message as {role, text, tool_calls, tool_call_id}."""
    return {"role": msg.get("role", "?"), "text": _content_text(msg.get("content")),
            "tool_calls": _tool_calls(msg.get("tool_calls")), "tool_call_id": msg.get("tool_call_id")}


def answer_view(api: str, response: dict | None) -> dict | None:
    """The assistant's answer in a recorded `response` of `api` (that API's own wire shape), read
    by the API's gateway module (`app.proxy.apis`, the reader the splice uses too): a
    `message_view`; None when the API is unknown or the body holds no answer."""
    module = REGISTRY.get(api)
    answer = module.answer_of(response) if module is not None else None
    return message_view(answer) if answer is not None else None


def conversation(completions: list[Completion]) -> list[dict]:
    """Every model call in order, showing only the messages new since the previous call.

    Harnesses resend the whole history each call; when the previous call's messages are not a
    prefix of this one's (compaction, a sub-agent, a rewritten history) all are shown and the
    call is flagged `rewritten`.
    """
    calls, previous = [], []
    for c in completions:
        messages = list((c.normalized_request or {}).get("messages") or [])
        prefix = previous == messages[:len(previous)]
        new = messages[len(previous):] if prefix else messages
        calls.append({
            "completion": c, "new_messages": [message_view(m) for m in new], "rewritten": not prefix and bool(previous),
            "history": len(messages) - len(new), "answer": answer_view(c.api, c.response),
            "prompt_tokens": len(c.prompt_ids or []), "sampled_tokens": len(c.sampled_ids or []),
        })
        previous = messages
    return calls


def _decoder(model_name: str | None):
    """A token-id -> text function for the run's model, loaded on first use; None when this
    installation has no tokenizer for it (the view then shows ids)."""
    return decoder_for(model_name)


def logprob_colour(logprob: float) -> str:
    """Background for a sampled token: hue from red (p≈0) through yellow to green (p≈1)."""
    p = math.exp(max(min(logprob, 0.0), -50.0))
    return f"hsl({120 * p:.0f}, 75%, 80%)"


def token_view(traj: Trajectory, decode, kv_runs: Mapping[Any, Any] | None = None,
               reference: int | None = None) -> list[dict]:
    """A trajectory as display pieces: runs of context tokens (mask 0) as one grey piece each,
    every sampled token (mask 1) as its own piece with two colourings: `colour` by its rollout
    logprob, `lag` (a `token_versions.lag_class`) by how many versions the weights that sampled
    it (`version`; `kv_version`, the oldest KV it attended to) lag `reference`.  `call` marks
    where a completion's sampled span starts (index into `traj.completion_ids`).  `kv_runs`:
    the merged completions' `kv_versions` by id (`token_versions.trajectory_versions`)."""
    ids, mask, lps = list(traj.token_ids), list(traj.loss_mask), list(traj.logprobs)
    starts = {int(a): i for i, (a, _b) in enumerate((traj.meta or {}).get("spans") or [])}
    versions, kv = trajectory_versions(traj, kv_runs or {})
    pieces: list[dict] = []
    i = 0
    while i < len(ids):
        if mask[i]:
            text = decode([ids[i]]) if decode else f"⟨{ids[i]}⟩"
            pieces.append({"sampled": True, "text": text, "id": ids[i], "logprob": lps[i],
                           "colour": logprob_colour(lps[i]), "call": starts.get(i), "version": versions[i],
                           "kv_version": kv[i] if kv is not None else versions[i],
                           "lag": lag_class(versions[i], reference)})
            i += 1
            continue
        j = i
        while j < len(ids) and not mask[j]:
            j += 1
        text = decode(ids[i:j]) if decode else " ".join(f"⟨{t}⟩" for t in ids[i:j])
        pieces.append({"sampled": False, "text": text, "n": j - i, "start": i})
        i = j
    return pieces


def version_reference(s: Session, episode: Episode, group: dict, trajs: list[Trajectory]) -> tuple[int | None, str]:
    """The version the token view's lags count from, and the words that say which it is.

    For sequences a completed step trained: the weights the trainer held for that step, one
    before the version it produced (`TrainingStep.policy_version` is the version after the
    update), the reference its per-token lags had in training (`app.training.steps.token_lags`).
    Otherwise (not trained, or not yet): the newest version that sampled any of the tokens."""
    if group.get("trained"):
        step = s.scalar(select(TrainingStep).where(TrainingStep.run_id == episode.run_id,
                                                   TrainingStep.step == group["step"]))
        if step is not None and step.policy_version is not None:
            return step.policy_version - 1, f"the weights step {step.step} trained"
    seen = [v for t in trajs for v in trajectory_versions(t, {})[0] if v is not None]
    if not seen:
        return None, "no version recorded"
    return max(seen), "the newest version that sampled these tokens"


def version_legend(sequences: list[dict], reference: int | None) -> list[dict]:
    """The versions the token view shows, newest first: [{version, lag (int or None), cls}]."""
    shown = {p["version"] for sq in sequences for p in sq["pieces"] if p["sampled"]}
    return [{"version": v, "lag": reference - v if v is not None and reference is not None else None,
             "cls": lag_class(v, reference)}
            for v in sorted(shown, key=lambda v: (v is None, -(v or 0)))]


def episode_detail(s: Session, episode_id: int) -> dict | None:
    """The episode page: grading report, patch, harness log tails, the conversation and the token view."""
    e = s.get(Episode, episode_id)
    if e is None:
        return None
    run = e.run
    cfg = run.config or {}
    builder = (cfg.get("training") or {}).get("builder") or "prefix_merging"
    trajs = s.scalars(select(Trajectory).where(Trajectory.episode_id == episode_id)
                      .order_by(Trajectory.builder, Trajectory.chain_index)).all()
    decode = _decoder((cfg.get("model") or {}).get("name")) if trajs else None
    comps = list(e.completions)
    group = episode_group(s, e)
    reference, reference_why = version_reference(s, e, group, list(trajs))
    kv_runs = {c.id: c.kv_versions for c in comps if c.kv_versions}
    sequences = []
    for t in trajs:
        sampled = [lp for lp, m in zip(t.logprobs, t.loss_mask) if m]
        sequences.append({"traj": t, "pieces": token_view(t, decode, kv_runs, reference), "tokens": len(t.token_ids),
                          "sampled": len(sampled), "mean_logprob": sum(sampled) / len(sampled) if sampled else None,
                          "completion_ids": t.completion_ids})
    seq_of = {c.id: c.seq for c in comps}
    return {
        "episode": e, "run": run, "config": cfg, "instance": e.instance.instance_id if e.instance else None,
        "duration_s": seconds_between(e.started_at, e.rollout_finished_at or e.finished_at),
        "grade_s": seconds_between(e.rollout_finished_at, e.finished_at),
        "report": e.grading_report or {}, "tests": grading_tests(e.grading_report),
        "surface": grading_surface(e.grading_report),
        "diff": diff_lines(e.patch), "logs": harness_logs(run.id, e.id),
        "calls": conversation(comps), "sequences": sequences, "builder": builder,
        "merge": (e.merge_stats or {}), "decoded": decode is not None, "seq_of": seq_of,
        "group": group, "reference": reference,
        "failure": failure_reason(e.status, e.resolved, e.error, e.timed_out, e.patch, e.grading_report), "reference_why": reference_why,
        "versions": version_legend(sequences, reference),
    }


