"""Held-out evaluation during a train run: `eval_every`, `eval_instances`, `eval_samples`.

A train run with `eval_every: N` makes, from its control loop, one eval run of its own (config
`eval_of: {run, step}`) when its policy has made 0, N, 2N, ... updates, and one more when it
completes: `eval_samples` samples of each held-out instance, at the train run's priority, on the
same engines, with half its rollout slots while it trains and all of them for the last eval (the
train run, done by then, rolls out nothing: with half of 8 slots `make learn`'s last eval took 10.4 s
an episode, against 9.2 s for its before-run at 8).  The trainer never waits for one: an eval is
another run whose rollouts interleave with the train run's, so a failed eval (shown on the run
page with its error) leaves the train run going.

Which weights an eval samples: the mid-run evals leave the engines as the train run keeps them,
so their episodes are served by the policy of step `step` and, once the train run syncs a newer
one, by later versions; every completion records the version that served it, and the curve
reports the range (`served_versions`).  The last eval loads the train run's newest checkpoint
(`model.checkpoint: run:<id>`): exactly the final policy.  A LoRA run's evals sample its
newest adapter instead (the gateway maps their sessions to it), the last one included.

When an eval completes, its pass@1 (the mean over instances of the resolved fraction) and a 95%
clustered bootstrap interval (`app.stats.compare_samples`: instances resampled, then samples
within them; Miller 2024, arXiv:2411.00640) are stored in its summary (`heldout_result`) and
logged to the train run's TensorBoard as `heldout/pass_at_1`, `heldout/pass_at_1_low`,
`heldout/pass_at_1_high` at global step `step`.  `curve` gives every point of the schedule with
its state: `pending` (not due yet, or the train run ended first), the eval run's own status
(`queued`: made, never started), and the result once there is one.
"""
from __future__ import annotations

import logging

from sqlalchemy import func, select

from app.tables import Completion, Episode, Run, TaskInstance
from app.runconfig import RunConfig
from app.transitions import TERMINAL

log = logging.getLogger("turnstile.heldout")
BOOTSTRAP_REPLICATES = 2000


def schedule(cfg: RunConfig) -> list[int]:
    """Policy updates after which the held-out set is evaluated: 0 (unless `eval_first` is false),
    N, 2N, ... below `steps`, and `steps`."""
    if not cfg.eval_every:
        return []
    return sorted({*range(0 if cfg.eval_first else cfg.eval_every, cfg.steps, cfg.eval_every), cfg.steps})


def resolve_instances(cfg: RunConfig) -> list[str]:
    """Instance ids of `cfg.eval_instances` (a list as given, or a split spec of the run's task set).

    Raises ValueError naming what exists when the spec names another task set, or a split or
    seed that does not exist; what `load_task_set` raises for a set that cannot be read.
    """
    spec = cfg.eval_instances
    if not isinstance(spec, str):
        return list(spec or [])
    from app.tasksets.loader import load_task_set
    from app.tasksets.starter.splits import parse_spec, spec_ids

    name, _, _ = parse_spec(spec)
    if name != cfg.task_set:
        raise ValueError(f"{spec!r} is a split of task set {name!r}, but the run's task_set is {cfg.task_set!r}")
    return spec_ids(load_task_set(name).raw, spec)


def problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """`[("eval_instances", message)]` when the held-out instances cannot be resolved; [] otherwise.

    For a simulated run a list of ids is not checked (its instances are placeholders); a split
    spec always is.
    """
    if not cfg.eval_instances:
        return []
    try:
        ids = resolve_instances(cfg)
    except (ValueError, FileNotFoundError) as exc:
        return [("eval_instances", str(exc).split("\n", 1)[0])]
    if cfg.simulate is None and not isinstance(cfg.eval_instances, str):
        from app.tasksets.loader import load_task_set

        try:
            known = set(load_task_set(cfg.task_set).by_id())
        except (ValueError, FileNotFoundError):
            return []  # the task_set problem is reported by the installation checks
        missing = [i for i in ids if i not in known]
        if missing:
            return [("eval_instances", f"task set {cfg.task_set!r} has no instance(s) {missing[:10]}")]
    return []


def eval_config(cfg: RunConfig, run_id: int, step: int, instances: list[str], final: bool) -> dict:
    """The config of the eval run at `step` of train run `run_id` (JSON, as `POST /api/runs` takes)."""
    model = cfg.model.model_dump(mode="json")
    # A LoRA run's final policy is its newest adapter, which the gateway serves to its evals
    # (`app.proxy.sessions.current_adapter`); loading its merged checkpoint would replace the base
    # weights every LoRA run on these engines shares.
    model["checkpoint"] = f"run:{run_id}" if final and not cfg.training.lora else None
    # A mid-run eval shares the engines with the train run's own rollouts; the last one starts once
    # the train run has completed, so the slots it held are free.
    slots = cfg.scheduling.rollout_slots if final else max(1, cfg.scheduling.rollout_slots // 2)
    scheduling = {"rollout_slots": slots, "ready_depth": cfg.scheduling.ready_depth}
    out = {"kind": "eval", "task_set": cfg.task_set, "harness": cfg.harness, "runtime": cfg.runtime, "model": model,
           "instances": instances, "group_size": cfg.eval_samples, "tasks_per_step": len(instances), "steps": 1,
           "mode": cfg.mode, "timeouts": cfg.timeouts.model_dump(mode="json"),
           "budget": cfg.budget.model_dump(mode="json"), "scheduling": scheduling, "priority": cfg.priority,
           "splice_history": cfg.splice_history, "eval_of": {"run": run_id, "step": step}}
    if cfg.simulate is not None:
        out["simulate"] = cfg.simulate.model_dump(mode="json")
    return RunConfig.model_validate(out).model_dump(mode="json")


def plan_evals(s, run: Run, cfg: RunConfig, finished: bool) -> list[int]:
    """Make the eval runs now due for train run `run` (in session `s`); their ids, to be started.

    Due: every scheduled step below `steps` the policy has reached while the run is running,
    and the last one once the run has completed (`finished` in this pass).  Made once each
    (`summary.heldout_evals`: {step: eval run id}).  An instance list that no longer resolves
    is recorded as `summary.heldout_error` and no eval is made; the train run goes on.
    """
    if not cfg.eval_every:
        return []
    status = s.scalar(select(Run.status).where(Run.id == run.id))
    made = dict((run.summary or {}).get("heldout_evals") or {})
    due = [v for v in schedule(cfg) if v < cfg.steps and v <= run.policy_version and status == "running"]
    if finished and status == "completed":
        due.append(cfg.steps)
    due = [v for v in due if str(v) not in made]
    if not due:
        return []
    try:
        instances = resolve_instances(cfg)
    except (ValueError, FileNotFoundError) as exc:
        run.summary = {**(run.summary or {}), "heldout_error": str(exc)[:1000]}
        return []
    ids = []
    for v in due:
        child = Run(kind="eval", priority=run.priority,
                    config=eval_config(cfg, run.id, v, instances, final=v == cfg.steps))
        s.add(child)
        s.flush()
        made[str(v)] = child.id
        ids.append(child.id)
        log.info("run=%s event=heldout_eval step=%s eval_run=%s", run.id, v, child.id)
    run.summary = {**(run.summary or {}), "heldout_evals": made}
    return ids


def samples(s, run_id: int) -> dict[str, list[bool]]:
    """instance id -> resolved flag of each completed sample of run `run_id` (sample order)."""
    out: dict[str, list[bool]] = {}
    for name, resolved in s.execute(
            select(TaskInstance.instance_id, Episode.resolved).join(TaskInstance, TaskInstance.id == Episode.instance_id)
            .where(Episode.run_id == run_id, Episode.status == "completed")
            .order_by(TaskInstance.instance_id, Episode.group_index, Episode.sample_index)):
        out.setdefault(name, []).append(bool(resolved))
    return out


def result(s, run_id: int) -> dict:
    """pass@1 of eval run `run_id` with its 95% clustered bootstrap interval, the counts behind it
    and the policy versions that served it: {pass_at_1, low, high, instances, samples, resolved,
    served_versions: [min, max] or None}; pass_at_1 etc. None when no sample completed."""
    from app.stats import compare_samples

    flags = samples(s, run_id)
    low_v, high_v = s.execute(select(func.min(Completion.policy_version), func.max(Completion.policy_version))
                              .join(Episode, Episode.id == Completion.episode_id)
                              .where(Episode.run_id == run_id, Completion.rejected_reason.is_(None))).one()
    out = {"instances": len(flags), "samples": sum(len(f) for f in flags.values()),
           "resolved": sum(sum(f) for f in flags.values()),
           "served_versions": None if low_v is None else [int(low_v), int(high_v)],
           "pass_at_1": None, "low": None, "high": None}
    if flags:
        interval = compare_samples(flags, flags, replicates=BOOTSTRAP_REPLICATES, seed=0).before
        out.update(pass_at_1=interval.value, low=interval.low, high=interval.high)
    return out


def record_result(s, run: Run, cfg: RunConfig) -> dict | None:
    """Store the result of the completed held-out eval `run` (`summary.heldout_result`) and log it
    to its train run's TensorBoard at the eval's step; the result, or None for a run that is not
    such an eval.  Tracking never raises (app.training.tracking)."""
    if cfg.eval_of is None:
        return None
    from app.training.tracking import log_scalars

    out = result(s, run.id)
    run.summary = {**(run.summary or {}), "heldout_result": out}
    if out["pass_at_1"] is not None:
        log_scalars(cfg.eval_of.run, {"heldout/pass_at_1": out["pass_at_1"], "heldout/pass_at_1_low": out["low"],
                                      "heldout/pass_at_1_high": out["high"]}, cfg.eval_of.step)
    return out


def curve(s, run: Run) -> list[dict]:
    """Every scheduled held-out point of train run `run`, in step order: {step, run_id, status,
    error, pass_at_1, low, high, instances, samples, resolved, served_versions, episodes_done,
    episodes_total} (the eval's episodes ended and created so far, None before it is made).

    `status` is "pending" where no eval was made (not due yet, or the run ended first), else the
    eval run's status ("queued": made, not started; "running"; "completed"; "failed" with its
    error; "cancelled"); the figures are None until it completes.  [] for a run without eval_every.
    """
    cfg = run.run_config()
    made = (run.summary or {}).get("heldout_evals") or {}
    ids = [int(i) for i in made.values()]
    children = {r.id: r for r in s.scalars(select(Run).where(Run.id.in_(ids)))}
    progress: dict[int, list[int]] = {}  # eval run id -> [episodes ended, episodes]
    for run_id, status, n in s.execute(select(Episode.run_id, Episode.status, func.count())
                                       .where(Episode.run_id.in_(ids)).group_by(Episode.run_id, Episode.status)):
        counts = progress.setdefault(run_id, [0, 0])
        counts[0] += n if status in TERMINAL else 0
        counts[1] += n
    out = []
    for v in schedule(cfg):
        entry = {"step": v, "run_id": None, "status": "pending", "error": None, "pass_at_1": None, "low": None,
                 "high": None, "instances": None, "samples": None, "resolved": None, "served_versions": None,
                 "episodes_done": None, "episodes_total": None}
        child = children.get(int(made[str(v)])) if str(v) in made else None
        if child is not None:
            done, total = progress.get(child.id, (0, 0))
            entry.update(run_id=child.id, status=child.status, error=child.error, episodes_done=done,
                         episodes_total=total)
            entry.update((child.summary or {}).get("heldout_result") or {})
        out.append(entry)
    return out
