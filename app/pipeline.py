"""The real episode stages: runtime, harness, patch, grade, trajectories.

`app.episodes` calls these for runs that are not simulated.  Each function is
one stage's work, with no scheduling and no state transitions; those stay in
`app.episodes`, so both paths (real and simulated) share every claim and retry.

What it needs from a harness preset (`app.harnesses.get_preset(name)`):
`name`, `tools_dir() -> Path` (mounted read-only in the sandbox at the same path),
`path_prepend() -> list[str]` (PATH entries inside the sandbox, e.g. the npm bin
folder), `write_config(home, gateway_url, api_key, model, budget)`,
`env(home, gateway_url, api_key, model) -> dict`, `command(problem_statement, budget) -> list[str]`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app.config import get_settings
from app.db import session_scope
from app.runconfig import RunConfig

log = logging.getLogger("turnstile.pipeline")


@dataclass
class HarnessOutcome:
    """What a rollout produced: the agent's patch (unified diff, "" if none) and how it ended."""

    patch: str
    exit_status: str  # "exit 0", "exit 1", "timeout", "cancelled"
    timed_out: bool
    log_path: str | None = None


def episode_dir(run_id: int, episode_id: int) -> Path:
    path = get_settings().var_dir / "runs" / str(run_id) / "episodes" / str(episode_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


def prepare_runtime(record: dict, episode_id: int, cfg: RunConfig) -> dict:
    """Materialize the instance (cached base + venv) into a fresh runtime; returns its JSON state.

    The harness's tools folder is mounted read-only into the sandbox so the CLI can run there.
    Raises `RuntimeSetupError` when the base, the venv or the sandbox cannot be built.
    """
    from app.harnesses import get_preset
    from app.runtimes.local import LocalRuntime

    preset = get_preset(cfg.harness)
    tools = preset.tools_dir()
    runtime = LocalRuntime.prepare(record, ro_binds=[(tools, str(tools))], purpose="episode")
    return runtime.describe()


def release_runtime(state: dict) -> None:
    """Delete a runtime's folder (idempotent; a missing folder is fine)."""
    from app.runtimes.local import LocalRuntime

    LocalRuntime.attach(state).close()


def run_harness(claim, token: str, cancelled: Callable[[], bool]) -> HarnessOutcome:
    """Run the claim's harness preset headless in its runtime, every call through the gateway.

    The session `token` is the harness's API key; it is written only into the
    episode's scratch HOME and environment, never logged.  The harness gets the
    agent budget (`timeouts.agent_s`) as a hard wall-clock limit; on timeout the
    patch so far is kept and the episode is flagged.
    """
    from app.harnesses import get_preset
    from app.runtimes.local import LocalRuntime

    cfg: RunConfig = claim.cfg
    preset = get_preset(cfg.harness)
    runtime = LocalRuntime.attach(claim.runtime)
    model = cfg.model.name
    preset.write_config(runtime.home, runtime.gateway_url, token, model, cfg.budget)
    env = preset.env(Path(runtime.home_dir), runtime.gateway_url, token, model)
    command = preset.command(claim.record["problem_statement"], cfg.budget)
    result = runtime.run(command, env=env, timeout_s=cfg.timeouts.agent_s, network="gateway",
                         stdin="", path_prepend=preset.path_prepend())
    patch = runtime.patch()
    out_dir = episode_dir(claim.run_id, claim.episode_id)
    log_path = out_dir / f"harness-attempt{claim.attempt}.log"
    log_path.write_text(
        f"$ {preset.name} (exit {result.exit_code}, {result.duration_s:.1f} s, confined={runtime.confined})\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}\n".replace(token, "<session-token>")
    )
    status = "timeout" if result.timed_out else ("cancelled" if cancelled() else f"exit {result.exit_code}")
    return HarnessOutcome(patch=patch, exit_status=status, timed_out=result.timed_out, log_path=str(log_path))


def grade_and_build(record: dict, patch: str, episode_id: int, cfg: RunConfig) -> tuple[bool, float, dict, dict | None]:
    """Grade the patch with the instance's tests; for train/collect runs also build trajectories.

    Returns (resolved, reward, grading report, merge stats).  Reward is 1.0 if resolved else
    0.0 (SWE-bench's resolved criterion; `app.grading`).
    """
    from app.grading import grade

    result = grade(record, patch, timeout_s=cfg.timeouts.grade_s)
    report = dict(result.report)
    report["cached"] = result.cached
    merge_stats = None
    if cfg.kind in ("train", "collect"):
        from app.training.store import build_episode_trajectories

        builder = (cfg.training or {}).get("builder", "prefix_merging")
        with session_scope() as s:
            _rows, stats = build_episode_trajectories(s, episode_id, builder)
            merge_stats = {builder: stats}
    return bool(result.resolved), float(result.reward), report, merge_stats
