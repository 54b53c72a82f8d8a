"""The real stages: task instances, engines, runtime, harness, grader and trainer.

Each method is one stage's work, with no scheduling and no state transitions (those are
in `app.control.episodes` and `app.control.runs`), so real and simulated runs share every
claim and retry.

What a harness preset gives (`app.harnesses.get_preset(name)`): `name`, `tools_dir()`
(mounted read-only in the sandbox at the same path), `path_prepend()` (PATH entries inside
the sandbox), `write_config(home, gateway_url, api_key, model, budget)`,
`env(home, gateway_url, api_key, model)`, `command(problem_statement, budget)`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from sqlalchemy import func, select

from app.config import get_settings
from app.control.preflight import installation_problems
from app.control.stages import HARNESS_FAILED, Claim, GradeOutcome, HarnessOutcome, forfeit_record
from app.db import session_scope
from app.paths import RunPaths
from app.tables import START_WEIGHTS, Completion, Run
from app.runconfig import RunConfig

log = logging.getLogger("turnstile.stages")

# How a harness log says the model's context was too small: the gateway's own overflow
# wording in each API (OpenAI "maximum context length" / code "context_length_exceeded",
# Anthropic "prompt is too long", Gemini "maximum number of tokens") and the CLIs' paraphrases
# (Codex: "ran out of room in the model's context window").
OVERFLOW_WORDS = ("context length", "context_length", "context window", "prompt is too long",
                  "maximum number of tokens")
# Characters of the harness log kept in a failed episode's error (the error column holds 4000).
LOG_TAIL_CHARS = 2500


def usable_completions(episode_id: int, attempt: int) -> int:
    """Completions of the episode's rollout `attempt` with at least one sampled token (a count).

    Earlier attempts' completions (`Completion.attempt`) are not counted.  A call the gateway
    refused (context overflow, bad request) records no row at all.
    """
    with session_scope() as s:
        return int(s.scalar(select(func.count()).select_from(Completion).where(
            Completion.episode_id == episode_id, Completion.attempt == attempt,
            Completion.rejected_reason.is_(None), func.length(Completion.sampled_ids) > 0)) or 0)


def harness_failure(name: str, exit_code: int, timed_out: bool, timeout_s: int, log_text: str, log_path: Path) -> str:
    """The error of an attempt that made no usable model call: `HARNESS_FAILED`, one line naming
    the cause, then the last `LOG_TAIL_CHARS` characters of the harness log (at most ~2.7 KB)."""
    lower = log_text.lower()
    if timed_out:
        cause = f"{name} was killed at its {timeout_s} s time limit (timeouts.agent_s) before any model call was answered"
    elif any(word in lower for word in OVERFLOW_WORDS):
        cause = (f"{name} exited {exit_code}: its first prompt did not fit the model's context window "
                 "(the gateway answered with a context-length error)")
    elif exit_code == 0:
        cause = f"{name} exited 0 without making a model call"
    elif exit_code < 0 or exit_code > 128:
        signal = -exit_code if exit_code < 0 else exit_code - 128
        cause = f"{name} crashed (exit {exit_code}, signal {signal}) before any usable model call"
    else:
        cause = f"{name} exited {exit_code} without a usable model call"
    return f"{HARNESS_FAILED}{cause}\n--- harness log tail ({log_path}) ---\n{log_text[-LOG_TAIL_CHARS:]}"


# Every episode failed by a sandbox cap has an error starting with this (then the cap, one line).
SANDBOX_LIMIT = "sandbox limit reached by the harness's commands: "


def sandbox_limit_failure(limit_hit: str, log_text: str, log_path: Path) -> str:
    """The error of an attempt whose commands ran into a sandbox cap (`RunResult.limit_hit`: processes,
    memory, disk) before the policy sampled anything: `SANDBOX_LIMIT`, the cap, then the tail of
    the harness log.  Such an attempt is failed, not graded (the harness's own commands hit the
    deployment's limits).  After the policy sampled, a cap hit is the policy's doing: the episode
    forfeits (reward 0, `app.control.stages.forfeit_record`)."""
    return f"{SANDBOX_LIMIT}{limit_hit}\n--- harness log tail ({log_path}) ---\n{log_text[-LOG_TAIL_CHARS:]}"


class RealStages:
    """Harness episodes in local sandboxes, graded by the instance's own tests, trained by GRPO."""

    uses_engines = True

    def preflight(self, cfg: RunConfig) -> list[tuple[str, str]]:
        return installation_problems(cfg)

    # --- run start ----------------------------------------------------------------------

    def load_instances(self, cfg: RunConfig) -> list[int]:
        """Rows of the run's task set (all instances, or `cfg.instances` in that order).

        Raises FileNotFoundError / ValueError for a missing or bad task set, KeyError naming a
        missing instance.
        """
        from app.tasksets import load_task_set, upsert_instances

        task_set = load_task_set(cfg.task_set)
        wanted = cfg.instances or [r.instance_id for r in task_set.instances]
        records = [task_set.get(name) for name in wanted]
        with session_scope() as s:
            ids = upsert_instances(s, task_set.name, records)
        return [ids[name] for name in wanted]

    def setup_engines(self, run_id: int, cfg: RunConfig, shared_with: list[int]) -> None:
        """Load the run's checkpoint into every engine, or put embedded engines back on their base weights.

        Raises RuntimeError when an engine does not load the checkpoint (the run cannot be
        evaluated on the weights it asked for).  A failed base reset is recorded on the run,
        not raised: a scripted test engine has no weights, and every completion carries the
        version that actually answered it.
        """
        if cfg.model.checkpoint:
            self._load_checkpoint(run_id, cfg)
        elif cfg.eval_of is not None:
            return  # a held-out eval during a train run samples the engines as that run keeps them
        elif cfg.model.engine == "embedded":
            self._start_from_base(run_id, cfg, shared_with)

    def _load_checkpoint(self, run_id: int, cfg: RunConfig) -> None:
        from app.engines.client import weights_label
        from app.training.checkpoints import resolve_checkpoint
        from app.training.weight_sync import push_weights

        folder, version = resolve_checkpoint(cfg.model.checkpoint)
        if cfg.kind == "train":
            version = 0  # a train run numbers its own policy versions: the weights it starts from are 0
        urls = cfg.model.engine_urls or get_settings().engine_urls
        results = push_weights(urls, folder, version, engine_kind=cfg.model.engine)
        failed = {u: r for u, r in results.items() if r != "ok"}
        if failed:
            raise RuntimeError(f"engines did not load {folder}: {failed}")
        with session_scope() as s:
            run = s.get(Run, run_id)
            run.policy_version = version
            # What the engines must keep serving under this run: the watchdog reloads it into an
            # engine that restarts on other weights (`app.control.engine_resync`).
            run.summary = {**(run.summary or {}), START_WEIGHTS: {"path": weights_label(folder), "policy_version": version}}

    def _start_from_base(self, run_id: int, cfg: RunConfig, shared_with: list[int]) -> None:
        """Serve the base weights (version 0) unless another run is using the same engines.

        Engines are shared by every run of a deployment; a run that starts from the base model
        must not sample from a previous run's trained weights.  While another engine-using run
        is running, its weights are left alone and this run records which run it shares them with.
        """
        from app.training.weight_sync import reset_to_base

        if shared_with:
            with session_scope() as s:
                run = s.get(Run, run_id)
                run.summary = {**(run.summary or {}), "engines_shared_with_runs": shared_with}
            log.warning("run=%s event=shared_engines others=%s: not resetting the engines' weights", run_id, shared_with)
            return
        urls = cfg.model.engine_urls or get_settings().engine_urls
        failed = {u: r for u, r in reset_to_base(urls).items() if r != "ok"}
        if failed:
            log.warning("run=%s event=base_reset_failed engines=%s", run_id, failed)
            with session_scope() as s:
                run = s.get(Run, run_id)
                run.summary = {**(run.summary or {}), "engines_not_reset": failed}

    # --- episode stages -----------------------------------------------------------------

    def prepare(self, record: dict, episode_id: int, cfg: RunConfig) -> dict:
        """Prepare the instance's runtime (`cfg.runtime`: local, or its image: pulled and unpacked
        here, so the READY buffer holds ready images); returns its JSON state.

        The harness's tools are mounted read-only so the CLI can run there (in an image: its
        install folder, its interpreter and, for npm CLIs, Node, at fixed paths).
        Raises `RuntimeSetupError` when the base, the venv, the image or the sandbox cannot be built,
        or the harness cannot run in the instance's image.
        """
        from app.harnesses import get_preset
        from app.runtimes.choice import HarnessMounts, prepare_runtime, runtime_kind

        preset = get_preset(cfg.harness)
        image_kind = runtime_kind(cfg.runtime, record) == "oci"
        mounts = HarnessMounts(preset.name, preset.tools_dir(), preset.image_binds() if image_kind else [],
                               preset.image_programs() if image_kind else [])
        return prepare_runtime(record, cfg.runtime, mounts, purpose="episode").describe()

    def release(self, runtime: dict) -> None:
        from app.runtimes import attach_runtime

        attach_runtime(runtime).close()

    def rollout(self, claim: Claim, token: str, cancelled: Callable[[], bool]) -> HarnessOutcome:
        """Run the claim's harness preset headless in its runtime, every call through the gateway.

        The session `token` is the harness's API key; it is written only into the episode's
        scratch HOME and environment, never logged.  The harness gets the agent budget
        (`timeouts.agent_s`) as a hard wall-clock limit; on timeout the patch so far is kept
        and the episode is flagged.  An attempt that recorded no completion with sampled
        tokens (crash, context overflow on the first call, exit or timeout before any call)
        comes back with `failure` set (`harness_failure`): the policy was never asked, so
        there is nothing to reward.  An attempt whose policy did sample and whose commands hit a
        sandbox cap, or whose files make patch extraction fail or be refused (a link out of the
        workspace), comes back with `forfeit` set: it is scored 0, ungraded.
        """
        from app.harnesses import get_preset
        from app.runtimes import attach_runtime

        cfg = claim.cfg
        preset = get_preset(cfg.harness)
        runtime = attach_runtime(claim.runtime)
        path_prepend = preset.image_path_prepend() if runtime.kind == "oci" else preset.path_prepend()
        model = cfg.model.name
        preset.write_config(runtime.home, runtime.gateway_url, token, model, cfg.budget)
        env = preset.env(Path(runtime.home_dir), runtime.gateway_url, token, model)
        command = preset.command(claim.record["problem_statement"], cfg.budget)
        result = runtime.run(command, env=env, timeout_s=cfg.timeouts.agent_s, network="gateway",
                             stdin="", path_prepend=path_prepend,
                             should_stop=cancelled)  # a cancelled episode's harness is killed at once
        from app.runtimes.patch import PatchError, PatchRefused

        try:
            patch, patch_error = runtime.patch(), None
        except PatchRefused as exc:  # a link out of the workspace: the agent's own file
            patch, patch_error = "", forfeit_record("patch_refused", f"patch refused: {exc}")
        except PatchError as exc:  # files the agent wrote that git cannot read (extraction is hardened)
            patch, patch_error = "", forfeit_record("patch_extraction", f"patch extraction failed: {exc}")
        log_path = RunPaths(claim.run_id).harness_log(claim.episode_id, claim.attempt)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        limit = f"sandbox limit: {result.limit_hit}\n" if result.limit_hit else ""
        log_text = (f"$ {preset.name} (exit {result.exit_code}, {result.duration_s:.1f} s, confined={runtime.confined})\n"
                    f"{limit}--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}\n"
                    ).replace(token, "<session-token>")
        log_path.write_text(log_text)
        stopped = result.stopped or cancelled()
        status = "timeout" if result.timed_out else ("cancelled" if stopped else f"exit {result.exit_code}")
        failure = forfeit = None
        if status == "cancelled":
            pass
        elif usable_completions(claim.episode_id, claim.attempt) == 0:
            # The policy never sampled: whatever ended the attempt is not the policy's doing.
            failure = (sandbox_limit_failure(result.limit_hit, log_text, log_path) if result.limit_hit else
                       harness_failure(preset.name, result.exit_code, result.timed_out, cfg.timeouts.agent_s,
                                       log_text, log_path))
        elif result.limit_hit:  # the commands the policy chose ran into a cap
            forfeit = forfeit_record("sandbox_limit", f"{SANDBOX_LIMIT}{result.limit_hit}")
        elif patch_error is not None:
            forfeit = patch_error
        return HarnessOutcome(patch=patch, exit_status=status, timed_out=result.timed_out, log_path=str(log_path),
                              failure=failure, forfeit=forfeit)

    def grade(self, record: dict, patch: str, episode_id: int, cfg: RunConfig) -> GradeOutcome:
        """Grade the patch with the instance's tests; for train/collect runs also build trajectories.

        Reward is 1.0 if resolved else 0.0 (SWE-bench's resolved criterion; `app.grading`).
        """
        from app.grading import grade

        result = grade(record, patch, timeout_s=cfg.timeouts.grade_s)
        report = dict(result.report)
        report["cached"] = result.cached
        report["log_path"] = result.log_path  # the apply + eval script output the report was parsed from
        return GradeOutcome(bool(result.resolved), float(result.reward), report, _trajectories(episode_id, cfg))

    def forfeit(self, record: dict, episode_id: int, cfg: RunConfig, forfeit: dict) -> GradeOutcome:
        """Reward 0 for an episode its agent's own actions ended (`app.control.stages.forfeit_record`):
        not graded; trajectories built for train/collect runs, so it trains in its group."""
        report = {"resolved": False, "forfeit": forfeit}
        return GradeOutcome(False, 0.0, report, _trajectories(episode_id, cfg))

    # --- training -----------------------------------------------------------------------

    def train(self, run_id: int, step: int, episode_ids: list[int] | None = None) -> dict:
        from app.training.steps import train_step  # torch: imported in the gpu worker's child only

        return train_step(run_id, step, episode_ids)


def _trajectories(episode_id: int, cfg: RunConfig) -> dict | None:
    """Build the episode's trajectories for train/collect runs; {builder: merge stats}, else None."""
    if cfg.kind not in ("train", "collect"):
        return None
    from app.training.store import build_episode_trajectories

    builder = cfg.training.builder
    with session_scope() as s:
        _rows, stats = build_episode_trajectories(s, episode_id, builder)
    return {builder: stats}
