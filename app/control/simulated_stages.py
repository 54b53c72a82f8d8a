"""Simulated stages: timed sleeps and Bernoulli rewards instead of harness, grader and trainer.

For the scheduler bench (`bench/scheduler.py`, `bench/ready_buffer.py`) and the spine
tests: every state change a real run makes (claims, READY buffer, slots, groups, steps,
policy versions) happens through the same control code; only the work is replaced.

Episode durations are lognormal with median `episode_median_s` and log-sigma
`episode_sigma` (sigma 1.0 gives p99 ≈ 10x the median), capped at `max_episode_s`;
rewards are Bernoulli(`reward_p`), seeded per episode so a run is reproducible.
"""
from __future__ import annotations

import math
import random
import time
from typing import Callable

from sqlalchemy import select

from app.control.stages import Claim, GradeOutcome, HarnessOutcome
from app.db import session_scope
from app.tables import Run, TaskInstance, TrainingStep, utcnow
from app.runconfig import RunConfig, Simulation
from app.transitions import transition

TASK_SET = "simulated"


def simulated_duration(sim: Simulation, episode_id: int) -> float:
    """Lognormal episode length in seconds: median `sim.episode_median_s`, log-sigma `sim.episode_sigma`."""
    rng = random.Random(f"{sim.seed}:{episode_id}")
    if sim.episode_sigma == 0:
        duration = sim.episode_median_s
    else:
        duration = rng.lognormvariate(math.log(max(sim.episode_median_s, 1e-6)), sim.episode_sigma)
    return min(duration, sim.max_episode_s) if sim.max_episode_s is not None else duration


class SimulatedStages:
    """Stages that only take time (no harness, task files, grader, model or engine)."""

    uses_engines = False

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def preflight(self, cfg: RunConfig) -> list[tuple[str, str]]:
        return []  # nothing of this installation is used

    def load_instances(self, cfg: RunConfig) -> list[int]:
        """Placeholder instances `sim-<i>` (or `cfg.instances`) in the task set "simulated"."""
        names = cfg.instances or [f"sim-{i}" for i in range(cfg.tasks_per_step)]
        ids = []
        with session_scope() as s:
            for name in names:
                row = s.scalar(select(TaskInstance).where(TaskInstance.task_set == TASK_SET,
                                                          TaskInstance.instance_id == name))
                if row is None:
                    row = TaskInstance(task_set=TASK_SET, instance_id=name, repo=TASK_SET, record={"instance_id": name})
                    s.add(row)
                    s.flush()
                ids.append(row.id)
        return ids

    def setup_engines(self, run_id: int, cfg: RunConfig, shared_with: list[int]) -> None:
        return None

    def prepare(self, record: dict, episode_id: int, cfg: RunConfig) -> dict:
        time.sleep(self.sim.prepare_s)
        return {"simulated": True}

    def release(self, runtime: dict) -> None:
        return None

    def rollout(self, claim: Claim, token: str, cancelled: Callable[[], bool]) -> HarnessOutcome:
        """Sleep for the episode's simulated duration (cut at the agent budget, or when cancelled)."""
        duration = simulated_duration(self.sim, claim.episode_id)
        budget = claim.cfg.timeouts.agent_s
        deadline = time.monotonic() + min(duration, budget)
        while time.monotonic() < deadline:
            if cancelled():
                return HarnessOutcome("", "cancelled", False)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if duration > budget:
            return HarnessOutcome("", "timeout", True)
        return HarnessOutcome("", "submitted", False)

    def grade(self, record: dict, patch: str, episode_id: int, cfg: RunConfig) -> GradeOutcome:
        resolved = random.Random(f"reward:{self.sim.seed}:{episode_id}").random() < self.sim.reward_p
        return GradeOutcome(resolved, float(resolved), {"simulated": True})

    def forfeit(self, record: dict, episode_id: int, cfg: RunConfig, forfeit: dict) -> GradeOutcome:
        return GradeOutcome(False, 0.0, {"simulated": True, "resolved": False, "forfeit": forfeit})

    def train(self, run_id: int, step: int, episode_ids: list[int] | None = None) -> dict:
        """A training step of `sim.train_s` seconds that does everything a real step does to the
        run's state (step row, policy version); only the optimizer update is replaced by a sleep."""
        with session_scope() as s:
            row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == step))
            if row is None:
                raise LookupError(f"run {run_id} has no step {step}")
            if row.status == "completed":
                return dict(row.metrics or {})
            # pending, or training left behind by a killed worker and re-sent by the watchdog
            if not transition(s, TrainingStep, row.id, "training", expect=("pending", "training"),
                              **row.start_values(utcnow())):
                return {"skipped": f"step {step} is {row.status}"}
        time.sleep(self.sim.train_s)
        with session_scope() as s:
            run = s.get(Run, run_id)
            run.policy_version += 1
            row = s.scalar(select(TrainingStep).where(TrainingStep.run_id == run_id, TrainingStep.step == step))
            metrics = {**(row.metrics or {}), "simulated": True, "train_s": self.sim.train_s,
                       "policy_version": run.policy_version}
            transition(s, TrainingStep, row.id, "completed", policy_version=run.policy_version, finished_at=utcnow(),
                       metrics=metrics)
        return metrics
