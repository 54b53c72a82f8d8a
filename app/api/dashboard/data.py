"""What the dashboard pages show, read from SQL (and the episode's harness logs) as plain dicts.

Every function takes an open session and returns template-ready values; nothing here renders
HTML.  Aggregates are computed with grouped queries so the runs list costs a fixed number of
queries however many runs it shows.
"""
from __future__ import annotations

import datetime as dt
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from app.config import get_settings
from app.stats import pass_at_k, wilson
from app.paths import RunPaths
from app.proxy.apis import REGISTRY
from app.tables import (EPISODE_STATES, Completion, Episode, Run, TaskInstance, TrainingStep, Trajectory, aware_utc,
                        utcnow)
from app.transitions import TERMINAL

LOG_TAIL_BYTES = 64 * 1024
LOG_TAIL_LINES = 200


# --- small helpers ----------------------------------------------------------------------

def seconds_between(a: dt.datetime | None, b: dt.datetime | None) -> float | None:
    a, b = aware_utc(a), aware_utc(b)
    return (b - a).total_seconds() if a is not None and b is not None else None


def age(value: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """`42 s`, `5 min`, `3 h`, `2 d`: how long ago `value` was."""
    s = seconds_between(value, now or utcnow())
    if s is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit}"
    return f"{max(s, 0):.0f} s"


# --- runs list ----------------------------------------------------------------------------

def runs_overview(s: Session, status: str | None = None, kind: str | None = None, limit: int = 100) -> list[dict]:
    """One row per run, newest first: status, kind, harness, model, progress, reward, resolved rate,
    solved instances (`(solved, graded)`: instances with a resolved sample, of those graded), age."""
    q = select(Run).order_by(Run.id.desc()).limit(limit)
    if status:
        q = q.where(Run.status == status)
    if kind:
        q = q.where(Run.kind == kind)
    runs = s.scalars(q).all()
    ids = [r.id for r in runs]
    if not ids:
        return []
    counts: dict[int, dict[str, int]] = {}
    for run_id, st, n in s.execute(select(Episode.run_id, Episode.status, func.count())
                                   .where(Episode.run_id.in_(ids)).group_by(Episode.run_id, Episode.status)):
        counts.setdefault(run_id, {})[st] = n
    graded = {run_id: (n, mean, int(res or 0)) for run_id, n, mean, res in s.execute(
        select(Episode.run_id, func.count(), func.avg(Episode.reward), func.sum(cast(Episode.resolved, Integer)))
        .where(Episode.run_id.in_(ids), Episode.status == "completed").group_by(Episode.run_id))}
    per_instance = s.execute(
        select(Episode.run_id, Episode.instance_id, func.max(cast(Episode.resolved, Integer)))
        .where(Episode.run_id.in_(ids), Episode.status == "completed").group_by(Episode.run_id, Episode.instance_id))
    solved: dict[int, list[int]] = {}
    for run_id, _inst, best in per_instance:
        solved.setdefault(run_id, []).append(int(best or 0))
    steps_done = dict(s.execute(select(TrainingStep.run_id, func.count()).where(
        TrainingStep.run_id.in_(ids), TrainingStep.status == "completed").group_by(TrainingStep.run_id)).all())
    now = utcnow()
    rows = []
    for r in runs:
        cfg = r.config or {}
        by_status = counts.get(r.id, {})
        total = sum(by_status.values())
        done = sum(by_status.get(k, 0) for k in TERMINAL)
        n_graded, reward, resolved = graded.get(r.id, (0, None, 0))
        inst = solved.get(r.id, [])
        rows.append({
            "id": r.id, "kind": r.kind, "status": r.status,
            "harness": cfg.get("harness"), "model": (cfg.get("model") or {}).get("checkpoint") or (cfg.get("model") or {}).get("name"),
            "task_set": cfg.get("task_set"),
            "episodes_done": done, "episodes_total": total,
            "steps_done": steps_done.get(r.id, 0) if r.kind == "train" else None, "steps_total": cfg.get("steps"),
            "reward": float(reward) if reward is not None else None,
            "resolved_rate": resolved / n_graded if n_graded else None,
            "solved_instances": (sum(inst), len(inst)) if inst and r.kind != "train" else None,
            "age": age(r.created_at, now), "created_at": r.created_at, "error": r.error,
        })
    return rows


# --- one run ------------------------------------------------------------------------------

def _get(m: dict | None, path: str) -> float | None:
    node: Any = m or {}
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _staleness_mean(m: dict | None) -> float | None:
    hist = ((m or {}).get("scheduling") or {}).get("staleness_hist") or {}
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else None


# (chart title, [(series label, metric path or callable)], band between series 1 and 2)
CHARTS: list[tuple[str, list[tuple[str, Any]], bool]] = [
    ("reward (mean ± std)", [("mean", "reward_mean"), ("mean - std", lambda m: _diff(m, -1)), ("mean + std", lambda m: _diff(m, 1))], True),
    ("resolved rate", [("resolved", "resolved_rate")], False),
    ("loss", [("loss", "loss")], False),
    ("KL", [("kl", "kl")], False),
    ("clip fraction", [("clip fraction", "clip_fraction")], False),
    ("trainer vs rollout logprob gap (nats)", [("max |Δ|", "logprob_gap_max_abs"), ("mean |Δ|", "logprob_gap_mean_abs")], False),
    ("tokens trained", [("trained", "tokens_trained"), ("processed", "tokens_processed")], False),
    ("prefix merging", [("completions", "merge.completions"), ("merged", "merge.completions_merged"),
                        ("chains", "merge.chains"), ("cut", "merge.chains_cut"), ("rejected", "merge.rejected")], False),
    ("trainer busy / rollout slots", [("trainer busy", "scheduling.trainer_busy_fraction"),
                                      ("slot occupancy", "scheduling.rollout_slot_occupancy")], False),
    ("READY wait (s)", [("p50", "scheduling.ready_wait_s.p50"), ("max", "scheduling.ready_wait_s.max")], False),
    ("staleness (policy versions)", [("mean", _staleness_mean)], False),
]


def _diff(m: dict | None, sign: int) -> float | None:
    mean, std = _get(m, "reward_mean"), _get(m, "reward_std")
    return None if mean is None or std is None else mean + sign * std


def step_charts(steps: list[TrainingStep]) -> tuple[list[dict], list[str]]:
    """Per-step curves of the completed steps: ([{id, title, x, series, band}], titles with no data)."""
    done = [st for st in steps if st.status == "completed"]
    x = [st.step for st in done]
    charts, missing = [], []
    for index, (title, spec, band) in enumerate(CHARTS):
        series = []
        for label, how in spec:
            values = [how(st.metrics) if callable(how) else _get(st.metrics, how) for st in done]
            if any(v is not None for v in values):
                series.append({"label": label, "values": values})
        if not series:
            missing.append(title)
            continue
        charts.append({"id": f"chart-{index}", "title": title, "x": x, "series": series,
                       "band": band and len(series) == 3})
    return charts, missing


def run_detail(s: Session, run_id: int, status: str | None = None, instance: str | None = None,
               outcome: str | None = None, limit: int = 500) -> dict | None:
    """The run page: run, counts, live aggregates, steps, charts and the (filtered) episodes table."""
    run = s.get(Run, run_id)
    if run is None:
        return None
    counts = dict(s.execute(select(Episode.status, func.count()).where(Episode.run_id == run_id)
                            .group_by(Episode.status)).all())
    steps = s.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id).order_by(TrainingStep.step)).all()
    charts, missing = step_charts(steps)
    q = (select(Episode, TaskInstance.instance_id).join(TaskInstance, TaskInstance.id == Episode.instance_id)
         .where(Episode.run_id == run_id).order_by(Episode.id))
    if status:
        q = q.where(Episode.status == status)
    if instance:
        q = q.where(TaskInstance.instance_id == instance)
    if outcome == "resolved":
        q = q.where(Episode.resolved.is_(True))
    elif outcome == "unresolved":
        q = q.where(Episode.status == "completed", Episode.resolved.is_not(True))
    matched = s.scalar(select(func.count()).select_from(q.subquery()))
    rows = s.execute(q.limit(limit)).all()
    calls = dict(s.execute(select(Completion.episode_id, func.count()).where(
        Completion.episode_id.in_([e.id for e, _ in rows])).group_by(Completion.episode_id)).all()) if rows else {}
    episodes = []
    for e, name in rows:
        reason = e.error
        if reason is None and e.timed_out:
            reason = "harness timed out"
        if reason is None and e.grading_report and (e.grading_report.get("apply") or {}).get("reason"):
            reason = e.grading_report["apply"]["reason"]
        episodes.append({
            "id": e.id, "instance": name, "step": e.step, "group": e.group_index, "sample": e.sample_index,
            "status": e.status, "reward": e.reward, "resolved": e.resolved, "attempts": e.attempts,
            "duration_s": seconds_between(e.started_at, e.rollout_finished_at or e.finished_at),
            "calls": calls.get(e.id, 0), "exit_status": e.exit_status, "reason": reason,
            "policy_version": e.policy_version,
        })
    instances = s.scalars(select(TaskInstance.instance_id).join(Episode, Episode.instance_id == TaskInstance.id)
                          .where(Episode.run_id == run_id).distinct().order_by(TaskInstance.instance_id)).all()
    graded, reward, resolved = s.execute(
        select(func.count(), func.avg(Episode.reward), func.sum(cast(Episode.resolved, Integer)))
        .where(Episode.run_id == run_id, Episode.status == "completed")).one()
    n_calls, sampled_bytes = s.execute(
        select(func.count(Completion.id), func.coalesce(func.sum(func.length(Completion.sampled_ids)), 0))
        .join(Episode, Episode.id == Completion.episode_id).where(Episode.run_id == run_id)).one()
    cfg = run.config or {}
    return {
        "run": run, "config": cfg, "counts": counts, "total": sum(counts.values()),
        "terminal": run.status in TERMINAL, "age": age(run.created_at),
        "duration_s": seconds_between(run.started_at, run.finished_at or (None if run.status in TERMINAL else utcnow())),
        "graded": graded, "reward": float(reward) if reward is not None else None,
        "resolved_rate": int(resolved or 0) / graded if graded else None,
        "completions": n_calls, "sampled_tokens": int(sampled_bytes) // 4,
        "steps": steps, "steps_done": sum(1 for st in steps if st.status == "completed"),
        "charts": charts, "missing_charts": missing,
        "episodes": episodes, "episodes_matched": matched, "limit": limit, "instances": instances,
        "states": EPISODE_STATES,
        # what the live refresh compares with `GET /api/runs/<id>` to see that something changed
        "state": {"status": run.status, "episodes_by_status": counts, "policy_version": run.policy_version,
                  "steps": [st.status for st in steps], "completions": n_calls},
    }


# --- one episode --------------------------------------------------------------------------

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


# Where `app.engines.modeling.load_tokenizer` caches SmolLM2's tokenizer (the embedded models' vocabulary).
TOKENIZER_FILE = Path("models") / "smollm2-135m-instruct-tokenizer" / "tokenizer.json"


@lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The embedded models' tokenizer, read with the `tokenizers` library from the cache
    `load_tokenizer()` writes: 0.2 s to import instead of torch + transformers (~6 s and
    hundreds of MB in each API worker).  Builds the cache through `load_tokenizer()` when absent."""
    from tokenizers import Tokenizer

    path = get_settings().var_dir / TOKENIZER_FILE
    if not path.is_file():
        from app.engines.modeling import load_tokenizer  # writes the cache (torch, transformers: once)

        load_tokenizer()
    return Tokenizer.from_file(str(path))


def _decoder(model_name: str | None):
    """A token-id -> text function for the run's model, loaded on first use; None when this
    installation has no tokenizer for it (the view then shows ids)."""
    if model_name not in ("tiny", "smollm2"):
        return None
    tok = smollm2_tokenizer()
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def logprob_colour(logprob: float) -> str:
    """Background for a sampled token: hue from red (p≈0) through yellow to green (p≈1)."""
    p = math.exp(max(min(logprob, 0.0), -50.0))
    return f"hsl({120 * p:.0f}, 75%, 80%)"


def token_view(traj: Trajectory, decode) -> list[dict]:
    """A trajectory as display pieces: runs of context tokens (mask 0) as one grey piece each,
    every sampled token (mask 1) as its own piece coloured by its rollout logprob.  `call`
    marks where a completion's sampled span starts (index into `traj.completion_ids`)."""
    ids, mask, lps = list(traj.token_ids), list(traj.loss_mask), list(traj.logprobs)
    starts = {int(a): i for i, (a, _b) in enumerate((traj.meta or {}).get("spans") or [])}
    pieces: list[dict] = []
    i = 0
    while i < len(ids):
        if mask[i]:
            text = decode([ids[i]]) if decode else f"⟨{ids[i]}⟩"
            pieces.append({"sampled": True, "text": text, "id": ids[i], "logprob": lps[i],
                           "colour": logprob_colour(lps[i]), "call": starts.get(i)})
            i += 1
            continue
        j = i
        while j < len(ids) and not mask[j]:
            j += 1
        text = decode(ids[i:j]) if decode else " ".join(f"⟨{t}⟩" for t in ids[i:j])
        pieces.append({"sampled": False, "text": text, "n": j - i, "start": i})
        i = j
    return pieces


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
    sequences = []
    for t in trajs:
        sampled = [lp for lp, m in zip(t.logprobs, t.loss_mask) if m]
        sequences.append({"traj": t, "pieces": token_view(t, decode), "tokens": len(t.token_ids),
                          "sampled": len(sampled), "mean_logprob": sum(sampled) / len(sampled) if sampled else None,
                          "completion_ids": t.completion_ids})
    comps = list(e.completions)
    seq_of = {c.id: c.seq for c in comps}
    return {
        "episode": e, "run": run, "config": cfg, "instance": e.instance.instance_id if e.instance else None,
        "duration_s": seconds_between(e.started_at, e.rollout_finished_at or e.finished_at),
        "grade_s": seconds_between(e.rollout_finished_at, e.finished_at),
        "report": e.grading_report or {}, "tests": grading_tests(e.grading_report),
        "diff": diff_lines(e.patch), "logs": harness_logs(run.id, e.id),
        "calls": conversation(comps), "sequences": sequences, "builder": builder,
        "merge": (e.merge_stats or {}), "decoded": decode is not None, "seq_of": seq_of,
    }


# --- compare two eval runs ----------------------------------------------------------------

def _instance_results(s: Session, run_id: int) -> dict[str, tuple[int, int]]:
    rows = s.execute(select(TaskInstance.instance_id, func.count(), func.sum(cast(Episode.resolved, Integer)))
                     .join(TaskInstance, TaskInstance.id == Episode.instance_id)
                     .where(Episode.run_id == run_id, Episode.status == "completed")
                     .group_by(TaskInstance.instance_id)).all()
    return {name: (n, int(c or 0)) for name, n, c in rows}


def compare_runs(s: Session, a_id: int, b_id: int) -> dict | None:
    """pass@1 and pass@k per instance and overall for two runs, with 95% Wilson intervals.

    k is the smaller run's group size, so both columns estimate the same quantity.  Overall
    pass@k is the mean of the per-instance unbiased estimates; its interval treats instances
    as the unit (a resolved-instance count out of the instances graded).
    """
    a, b = s.get(Run, a_id), s.get(Run, b_id)
    if a is None or b is None:
        return None
    k = max(1, min(int((a.config or {}).get("group_size") or 1), int((b.config or {}).get("group_size") or 1)))
    results = [_instance_results(s, a.id), _instance_results(s, b.id)]
    names = sorted(set(results[0]) | set(results[1]))
    rows = []
    for name in names:
        cells = []
        for res in results:
            if name not in res:
                cells.append(None)
                continue
            n, c = res[name]
            cells.append({"n": n, "c": c, "pass1": c / n if n else None, "pass1_ci": wilson(c, n),
                          "passk": pass_at_k(n, c, k)})
        rows.append({"instance": name, "cells": cells})
    overall = []
    for res in results:
        n = sum(v[0] for v in res.values())
        c = sum(v[1] for v in res.values())
        estimates = [p for v in res.values() if (p := pass_at_k(v[0], v[1], k)) is not None]
        solved = sum(1 for v in res.values() if v[1] > 0)
        overall.append({"n": n, "c": c, "instances": len(res), "pass1": c / n if n else None,
                        "pass1_ci": wilson(c, n) if n else None,
                        "passk": sum(estimates) / len(estimates) if estimates else None,
                        "passk_ci": wilson(solved, len(res)) if len(res) else None})
    return {"runs": [a, b], "k": k, "rows": rows, "overall": overall}
