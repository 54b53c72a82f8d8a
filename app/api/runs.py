"""REST endpoints for runs, episodes and exports (documented in app/api/openapi.py).

Creating a run commits the row first and enqueues the `control.start_run` task
after (Celery's commit-before-enqueue rule), then answers 202 with a Location.
Status always comes from SQL, never from Celery results.
"""
from __future__ import annotations

import math
from typing import Iterator

from flask import Blueprint, Response, jsonify, request, url_for
from pydantic import ValidationError
from sqlalchemy import Integer, cast, func, select

from app.api import problems
from app.api.errors import ApiError, query_flag
from app.api.group_state import group_states
from app.api.openapi import openapi_spec
from app.api.trainer_state import trainer_state
from app.api.schemas import ExportLine, ExportTrajectory, Health
from app.api.serialize import completion_to_dict, episode_to_dict, run_to_dict
from app.api.tokenizer import decoder_for
from app.api.token_versions import trajectory_versions
from app.db import new_session, session_scope
from app.tables import EPISODE_STATES, Completion, Episode, Run, TrainingStep, Trajectory, utcnow
from app.runconfig import RunConfig
from app.text import text_problem
from app.transitions import TERMINAL, transition

bp = Blueprint("api", __name__)


def _validation_error(details: list[dict]) -> ApiError:
    """The 400 of a rejected run config: the first problem in the message, every one in `details`."""
    first = details[0]
    where = f"{first['field']}: " if first["field"] else ""
    return ApiError(400, f"invalid run config: {where}{first['message']}", first["field"], details)


def _top(field: str | None) -> str | None:
    return field.split(".", 1)[0] if field else None


def config_problems(body: dict) -> tuple[RunConfig | None, list[dict]]:
    """The validated config of a request body (None when invalid) and every problem with it.

    Problems are `{"field", "message"}` dicts (`app.api.problems` words them: value received, "did
    you mean").  Schema problems come first; then this installation's checks
    (`app.control.runs.run_config_problems`: task set, instances, model, harness, ...), which also
    run when the schema failed, on the body without its bad top-level fields, so one round trip
    names every problem.  An installation problem of a field that was itself bad is left out (it
    would be about the default that replaced it).
    """
    from app.control.runs import run_config_problems  # validates choices against this installation

    try:
        return _checked(RunConfig.model_validate(body), [], set(), run_config_problems)
    except ValidationError as exc:
        details = problems.schema_problems(exc, RunConfig)
    bad = {_top(d["field"]) for d in details}
    try:
        partial = RunConfig.model_validate({k: v for k, v in body.items() if k not in bad})
    except ValidationError:
        return None, details
    _cfg, extra = _checked(partial, details, bad, run_config_problems)
    return None, extra


def _checked(cfg: RunConfig, details: list[dict], bad: set, check) -> tuple[RunConfig | None, list[dict]]:
    found = [{"field": f, "message": m} for f, m in check(cfg) if _top(f) not in bad]
    out = details + found
    return (cfg if not out else None), out


def _status_counts(session, run_id: int) -> dict[str, int]:
    rows = session.execute(
        select(Episode.status, func.count()).where(Episode.run_id == run_id).group_by(Episode.status)
    ).all()
    return {status: n for status, n in rows}


def _live_stats(session, run_id: int) -> dict:
    """Cheap aggregates for progress displays: captures, sampled tokens, graded reward."""
    n, sampled_bytes = session.execute(
        select(func.count(Completion.id), func.coalesce(func.sum(func.length(Completion.sampled_ids)), 0))
        .join(Episode, Episode.id == Completion.episode_id).where(Episode.run_id == run_id)
    ).one()
    graded, reward = session.execute(
        select(func.count(Episode.id), func.avg(Episode.reward))
        .where(Episode.run_id == run_id, Episode.status == "completed")
    ).one()
    return {"completions": n, "sampled_tokens": int(sampled_bytes) // 4, "graded": graded,
            "reward_mean": float(reward) if reward is not None else None}


def _get_run(session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise ApiError(404, f"run {run_id} not found")
    return run


@bp.get("/openapi.json")
def get_openapi():
    return jsonify(openapi_spec())


@bp.get("/health")
def health():
    return jsonify(Health().model_dump(mode="json"))


def _unstorable(body) -> tuple[str, str] | None:
    """The first value of a parsed JSON body that SQL cannot store, as (field path, problem), or None.

    Text as `app.text.text_problem` defines it (U+0000, lone UTF-16 surrogates); PostgreSQL's JSONB
    also rejects non-finite numbers, which Python's JSON parser accepts (`NaN`).  Iterative: depth is
    bounded by the parser.
    """
    stack = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                problem = text_problem(key)
                if problem:
                    return where, f"field name {problem}"
                stack.append((where, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            return path, "must be a finite number"
        elif isinstance(value, str):
            problem = text_problem(value)
            if problem:
                return path, problem
    return None


@bp.post("/runs")
def create_run():
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    bad = _unstorable(body)
    if bad is not None:
        raise ApiError(400, f"invalid run config: {bad[0]}: {bad[1]}", bad[0] or None)
    from app.api.labels import LABEL_FIELDS, labels_problems  # name, tags, notes: not run options

    labels, details = labels_problems(body, LABEL_FIELDS)
    body = {k: v for k, v in body.items() if k not in LABEL_FIELDS}
    cfg, config_details = config_problems(body)
    details += config_details
    if cfg is not None and cfg.kind == "tinker":
        details.append({"field": "kind", "message": "'tinker': a Tinker model is made by its SDK client through the "
                                                    "Tinker service (create_lora_training_client), not here"})
    if not details:  # train runs sharing this deployment's engines: LoRA pool or full fine-tune alone
        from app.control.tenancy import engine_problems

        details = [{"field": f, "message": m} for f, m in engine_problems(cfg)]
    if details:
        raise _validation_error(details)
    from app.provenance import HEADER, parse_claim, record

    stored = cfg.model_dump(mode="json")
    origins = record(stored, body, parse_claim(request.headers.get(HEADER)))
    if query_flag("dry_run"):  # checked only: the CLI asks before a warm start
        return jsonify({"config": stored, "provenance": origins})
    # eval runs default to 5; a priority the body gives (0 included) is kept
    priority = cfg.priority if origins.get("priority") != "default" else (5 if cfg.kind == "eval" else 0)
    with session_scope() as session:
        run = Run(kind=cfg.kind, config=stored, priority=priority, provenance=origins)
        session.add(run)
        run.name, run.tags, run.notes = labels.get("name"), sorted(labels.get("tags") or []) or None, labels.get("notes")
        session.flush()
        run_id = run.id
    from app.tasks.send import send_start_run  # on first use: importing app.celery reads the settings once

    send_start_run(run_id, priority)
    with session_scope() as session:
        payload = run_to_dict(session.get(Run, run_id))
    from app.control.tenancy import engine_notice

    notice = engine_notice(cfg, run_id)  # a full fine-tune next to others on the same engines: said, not refused
    if notice is not None:
        payload["engines_notice"] = notice
    resp = jsonify(payload)
    resp.status_code = 202
    resp.headers["Location"] = url_for("api.get_run", run_id=run_id)
    return resp


@bp.get("/runs")
def list_runs():
    raw = request.args.get("limit", "50")
    if not raw.isdigit() or not 1 <= int(raw) <= 500:
        raise ApiError(400, "limit: must be an integer from 1 to 500", "limit")
    limit = int(raw)
    from app.api.labels import RunFilter

    try:
        where = RunFilter.from_args(request.args)
    except ValueError as exc:
        raise ApiError(400, str(exc), str(exc).split(":", 1)[0]) from None
    with session_scope() as session:
        runs = session.scalars(where.apply(select(Run)).order_by(Run.id.desc()).limit(limit)).all()
        graded = _graded_stats(session, [r.id for r in runs])
        out = []
        for r in runs:
            live = graded.get(r.id, {"graded": 0, "reward_mean": None, "resolved_rate": None})
            out.append(run_to_dict(r, _status_counts(session, r.id), live=live))
        return jsonify({"runs": out})


def _graded_stats(session, run_ids: list[int]) -> dict[int, dict]:
    """Per run: graded episodes, their mean reward and resolved rate (one grouped query)."""
    if not run_ids:
        return {}
    rows = session.execute(
        select(Episode.run_id, func.count(), func.avg(Episode.reward), func.sum(cast(Episode.resolved, Integer)))
        .where(Episode.run_id.in_(run_ids), Episode.status == "completed").group_by(Episode.run_id)
    ).all()
    return {run_id: {"graded": n, "reward_mean": float(mean) if mean is not None else None,
                     "resolved_rate": int(res or 0) / n if n else None} for run_id, n, mean, res in rows}


@bp.get("/runs/<id:run_id>")
def get_run(run_id: int):
    with session_scope() as session:
        run = _get_run(session, run_id)
        steps = list(session.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)
                                     .order_by(TrainingStep.step)))
        payload = run_to_dict(run, _status_counts(session, run_id), live=_live_stats(session, run_id), steps=steps,
                              trainer=trainer_state(session, run, steps))
        if run.kind == "tinker":
            from app.control.tinker_progress import progress

            payload["tinker"] = progress(session, run_id)  # optim steps, losses, sampler checkpoints
        if run.kind == "train" and (run.config or {}).get("eval_every"):
            from app.control.heldout import curve

            payload["heldout"] = curve(session, run)  # the `eval_every` evals, one entry per scheduled step
        return jsonify(payload)


@bp.post("/runs/<id:run_id>/cancel")
def cancel_run(run_id: int):
    with session_scope() as session:
        run = _get_run(session, run_id)
        if run.status in TERMINAL:
            raise ApiError(409, f"run {run_id} is already {run.status}")
        # A run no control worker has started has nothing to stop: it ends here, so its cancel
        # completes even when no worker runs.  The compare-and-set loses to a start under way
        # (the run is `running` then) and the cancel goes to the control worker as usual; a start
        # message that arrives later finds the run cancelled and does nothing.
        if transition(session, Run, run_id, "cancelled", expect=("queued",), finished_at=utcnow()):
            session.commit()
            return jsonify(run_to_dict(session.get(Run, run_id, populate_existing=True))), 202
        transition(session, Run, run_id, "cancelling")
    from app.tasks.send import send_cancel_run

    send_cancel_run(run_id)
    with session_scope() as session:
        return jsonify(run_to_dict(session.get(Run, run_id))), 202


@bp.get("/runs/<id:run_id>/episodes")
def list_episodes(run_id: int):
    status = request.args.get("status")
    if status and status not in EPISODE_STATES:
        raise ApiError(400, f"status: must be one of {', '.join(EPISODE_STATES)}", "status")
    with session_scope() as session:
        run = _get_run(session, run_id)
        q = select(Episode).where(Episode.run_id == run_id).order_by(Episode.id)
        if status:
            q = q.where(Episode.status == status)
        states = group_states(session, run)  # every group's at once, not per episode
        return jsonify({"episodes": [episode_to_dict(e, group=states.get(e.group_index)) for e in session.scalars(q)]})


@bp.get("/episodes/<id:episode_id>")
def get_episode(episode_id: int):
    with session_scope() as session:
        ep = session.get(Episode, episode_id)
        if ep is None:
            raise ApiError(404, f"episode {episode_id} not found")
        return jsonify(episode_to_dict(ep, completions=list(ep.completions)))


def _export_lines(run_id: int) -> Iterator[str]:
    """One JSON line per episode (`app.api.schemas.ExportLine`): messages of its last call,
    completions with token ids, trajectories.  Completions and trajectories carry the policy
    version of every token (`token_policy_versions`, parallel to `sampled_ids` and `token_ids`)
    and, where a completion recorded KV older than its weights, `token_kv_versions`, decoded
    from the stored runs (`app.api.token_versions`)."""
    session = new_session()
    try:
        ids = session.scalars(select(Episode.id).where(Episode.run_id == run_id).order_by(Episode.id)).all()
        for episode_id in ids:
            ep = session.get(Episode, episode_id)
            comps = [completion_to_dict(c) for c in ep.completions]
            trajs = session.scalars(
                select(Trajectory).where(Trajectory.episode_id == episode_id).order_by(Trajectory.chain_index)
            ).all()
            record = episode_to_dict(ep)
            usable = [c for c in ep.completions if c.rejected_reason is None]
            record["messages"] = _messages_of(usable[-1] if usable else None,
                                              ep.run.run_config().model.name)
            record["completions"] = comps
            kv_runs = {c.id: c.kv_versions for c in ep.completions if c.kv_versions}
            record["trajectories"] = [_export_trajectory(t, kv_runs) for t in trajs]
            yield ExportLine(**record).model_dump_json() + "\n"
            session.expunge_all()
    finally:
        session.close()


def _export_trajectory(t: Trajectory, kv_runs: dict) -> ExportTrajectory:
    policy, kv = trajectory_versions(t, kv_runs)
    return ExportTrajectory(builder=t.builder, chain_index=t.chain_index, token_ids=t.token_ids,
                            loss_mask=t.loss_mask, logprobs=t.logprobs, completion_ids=t.completion_ids,
                            token_policy_versions=policy, token_kv_versions=kv)


def _messages_of(completion: Completion | None, model_name: str | None) -> list | None:
    """The episode's conversation for SFT: its last call's messages (Chat Completions form, as the
    engine saw them) plus the final answer.  The answer is the policy's own raw text: the decoded
    sampled ids (tool-call markup included) for the embedded models, else the Chat answer."""
    if completion is None or not completion.normalized_request:
        return None
    messages = list(completion.normalized_request.get("messages", []))
    text = None
    decode = decoder_for(model_name) if completion.sampled_ids else None  # tokenizers only: no torch here
    if decode is not None:
        text = decode(completion.sampled_ids)
    elif completion.api == "chat" and completion.response:
        choice = (completion.response.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content")
    if text is not None:
        messages.append({"role": "assistant", "content": text})
    return messages


@bp.get("/runs/<id:run_id>/export")
def export_run(run_id: int):
    with session_scope() as session:
        _get_run(session, run_id)
    return Response(
        _export_lines(run_id),
        mimetype="application/x-ndjson",
        headers={"Content-Disposition": f"attachment; filename=run-{run_id}.jsonl"},
    )
