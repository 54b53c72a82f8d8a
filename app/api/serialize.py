"""Row -> JSON dicts for the REST API, built through the response models of `app.api.schemas`
(so every body has exactly the documented fields, in the documented order)."""
from __future__ import annotations

import datetime as dt

from sqlalchemy.orm import object_session

from app.api import schemas
from app.api.group_state import episode_state
from app.api.token_versions import completion_versions
from app.config import get_settings
from app.control.failure import failure_reason
from app.tables import Completion, Episode, Run, TrainingStep, aware_utc, utcnow


def _ts(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def waiting_reason(run: Run, now: dt.datetime | None = None) -> str | None:
    """Why a run is not moving, when no control worker has acted on it in time; else None.

    A control worker takes a queued run as soon as its start message arrives, and the beat's
    watchdog re-sends a lost start (or ticks a cancelling run) every `watchdog_interval_s`; a
    worker that died mid-stage is seen once its lease (`lease_ttl_s`) expires.  So a run still
    `queued` (since `created_at`) or `cancelling` (since `updated_at`, the cancel request) after
    `lease_ttl_s + watchdog_interval_s` seconds has no control worker (or no beat) serving it.
    """
    if run.status not in ("queued", "cancelling"):
        return None
    settings = get_settings()
    limit = settings.lease_ttl_s + settings.watchdog_interval_s
    since = aware_utc(run.created_at if run.status == "queued" else run.updated_at)
    if since is None:
        return None
    waited = ((now or utcnow()) - since).total_seconds()
    if waited <= limit:
        return None
    what = "taken this run" if run.status == "queued" else "finished its cancel"
    return (f"no control worker has {what} in {waited:.0f} s (more than a {settings.lease_ttl_s:.0f} s lease plus "
            f"a {settings.watchdog_interval_s:.0f} s watchdog period): is a `worker` process serving queue "
            f"`control` running (`make up`), with `beat`, on the broker the API sends to (REDIS_URL, CELERY_BROKER_URL)?"
            + (" A queued run can be cancelled at once: `turnstile cancel " + str(run.id) + "`."
               if run.status == "queued" else ""))


def run_to_dict(run: Run, counts: dict[str, int] | None = None, live: dict | None = None,
                steps: list[TrainingStep] | None = None, trainer: dict | None = None) -> dict:
    return schemas.Run(**{
        "id": run.id,
        "kind": run.kind,
        "status": run.status,
        "name": run.name,
        "tags": run.tags or [],
        "notes": run.notes,
        "policy_version": run.policy_version,
        "priority": run.priority,
        "config": run.config,
        "error": run.error,
        "summary": run.summary,
        "provenance": run.provenance,
        "episodes_by_status": counts or {},
        "created_at": _ts(run.created_at),
        "started_at": _ts(run.started_at),
        "finished_at": _ts(run.finished_at),
        "live": live,
        "steps": [step_to_dict(st) for st in steps] if steps is not None else None,
        "trainer": trainer,
        "waiting": waiting_reason(run),
    }).model_dump(mode="json")


def episode_to_dict(ep: Episode, completions: list[Completion] | None = None, group: dict | None = None) -> dict:
    """The episode's JSON; `group`: its group's `app.api.group_state.group_state` when the caller
    computed every group's at once (`group_states`), else read here from the episode's session."""
    if group is None:
        group = episode_state(object_session(ep), ep)
    return schemas.Episode(**{
        "id": ep.id,
        "run_id": ep.run_id,
        "instance_id": ep.instance.instance_id if ep.instance is not None else None,
        "step": group["step"] if ep.run.kind == "train" else ep.step,
        "group": group,
        "failure_reason": failure_reason(ep.status, ep.resolved, ep.error, ep.timed_out, ep.patch, ep.grading_report),
        "group_index": ep.group_index,
        "sample_index": ep.sample_index,
        "status": ep.status,
        "attempts": ep.attempts,
        "policy_version": ep.policy_version,
        "exit_status": ep.exit_status,
        "timed_out": ep.timed_out,
        "reward": ep.reward,
        "resolved": ep.resolved,
        "patch": ep.patch,
        "grading_report": ep.grading_report,
        "merge_stats": ep.merge_stats,
        "error": ep.error,
        "created_at": _ts(ep.created_at),
        "started_at": _ts(ep.started_at),
        "finished_at": _ts(ep.finished_at),
        "completions": [completion_to_dict(c) for c in completions] if completions is not None else None,
    }).model_dump(mode="json")


def completion_to_dict(c: Completion, with_tokens: bool = True) -> dict:
    out = {
        "id": c.id,
        "seq": c.seq,
        "api": c.api,
        "model": c.model,
        "stream": c.stream,
        "finish_reason": c.finish_reason,
        "engine_id": c.engine_id,
        "policy_version": c.policy_version,
        "queue_ms": c.queue_ms,
        "first_token_ms": c.first_token_ms,
        "total_ms": c.total_ms,
        "partial": c.partial,
        "error": c.error,
        "rejected_reason": c.rejected_reason,
        "prompt_tokens": len(c.prompt_ids or []),
        "sampled_tokens": len(c.sampled_ids or []),
        "created_at": _ts(c.created_at),
    }
    if with_tokens:
        policy, kv = completion_versions(c)
        out.update(
            normalized_request=c.normalized_request,
            response=c.response,
            prompt_ids=c.prompt_ids,
            sampled_ids=c.sampled_ids,
            logprobs=c.logprobs,
            token_policy_versions=policy if c.sampled_ids is not None else None,
            token_kv_versions=kv,
        )
    return schemas.Completion(**out).model_dump(mode="json")


def step_to_dict(s: TrainingStep) -> dict:
    return schemas.Step(**{
        "step": s.step,
        "status": s.status,
        "policy_version": s.policy_version,
        "episode_ids": s.episode_ids,
        "metrics": s.metrics,
        "checkpoint_path": s.checkpoint_path,
        "error": s.error,
        "started_at": _ts(s.started_at),
        "finished_at": _ts(s.finished_at),
    }).model_dump(mode="json")
