"""The work of each stage, behind one interface: real (harness, grader, trainer) or simulated.

The control code (`app.control.runs`, `app.control.episodes`) owns claims, state
transitions, retries and scheduling; a `Stages` object does only the work of a stage and
returns its result.  Which implementation a run gets is decided in one place,
`app.control.runs.stages_for`, by its config: `simulate` set → `SimulatedStages` (timed
sleeps and Bernoulli rewards for the scheduler bench and the spine tests), otherwise
`RealStages`.  Nothing else in production code looks at `simulate`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from app.runconfig import RunConfig


@dataclass
class Claim:
    """What a rollout needs after its claim: the episode, its run config, instance record and runtime."""

    episode_id: int
    run_id: int
    attempt: int
    cfg: RunConfig
    record: dict
    runtime: dict | None
    policy_version: int


# Every harness-failure episode's error starts with this, so the scheduler and the summary
# can count them in SQL (`Episode.error LIKE HARNESS_FAILED + '%'`).
HARNESS_FAILED = "harness failed before any usable model call: "
# An episode failed by an exception in one of its stages: its error starts with the stage's prefix
# (`app.control.episodes`), and the failure reason is read back by it (`app.control.failure`).
STAGE_FAILED = {"prepare": "prepare failed: ", "rollout": "rollout failed: ", "grading": "grading failed: "}
# An episode failed by the reaper after its stage's lease expired too often (`app.control.reaper`).
LEASE_LOST = "the stage's lease expired"


@dataclass
class HarnessOutcome:
    """What a rollout produced: the agent's patch (unified diff, "" if none) and how it ended.

    `failure` is set when the attempt recorded no completion with sampled tokens (the harness
    crashed, overflowed the context on its first call, exited or timed out before calling):
    one line naming the cause, followed by the tail of the harness log.  Such an episode is
    failed, not graded: a reward of 0 would say the policy tried and lost.  Simulated stages
    never set it.  `forfeit` is set when the policy did sample and the agent's own actions ended
    the episode (`FORFEIT_CAUSES`): it is scored 0 without grading.
    """

    patch: str
    exit_status: str  # "exit 0", "exit 1", "timeout", "cancelled", "submitted"
    timed_out: bool
    log_path: str | None = None
    failure: str | None = None
    forfeit: dict | None = None  # `forfeit_record(...)`: the agent's own actions ended it; reward 0


# The ends of an episode that the agent's own actions caused after the policy sampled (a sandbox
# cap its commands hit, files it wrote that patch extraction refuses or cannot read).  Such an
# episode is not graded and not failed: it trains with reward 0 in its GRPO group, because the
# policy chose those actions.  A policy must not escape a zero reward by breaking its own episode
# (a failed episode is left out of its group and never gets its negative advantage).
FORFEIT_CAUSES = ("sandbox_limit", "patch_extraction", "patch_refused")


def forfeit_record(cause: str, reason: str) -> dict:
    """The `grading_report["forfeit"]` of an episode that ends with reward 0 by its own actions:
    {"cause": one of `FORFEIT_CAUSES`, "reason": one line (at most 2000 characters)}.
    Raises ValueError for an unknown cause."""
    if cause not in FORFEIT_CAUSES:
        raise ValueError(f"unknown forfeit cause {cause!r}; one of {', '.join(FORFEIT_CAUSES)}")
    return {"cause": cause, "reason": reason.strip().split("\n", 1)[0][:2000]}


def harness_failure_cause(error: str | None) -> str | None:
    """The one-line cause of a harness-failure episode's `error`, or None for any other error."""
    if not error or not error.startswith(HARNESS_FAILED):
        return None
    return error[len(HARNESS_FAILED):].split("\n", 1)[0]


@dataclass
class GradeOutcome:
    """A graded episode: SWE-bench's resolved criterion, the reward (1.0 resolved else 0.0),
    the grading report (JSON), and per-builder merge stats when trajectories were built."""

    resolved: bool
    reward: float
    report: dict
    merge_stats: dict | None = None


class Stages(Protocol):
    """One implementation of every stage's work.  Methods raise on failure; the caller records it."""

    #: True when the stages sample from the shared inference engines (they then matter to other runs).
    uses_engines: bool

    def preflight(self, cfg: RunConfig) -> list[tuple[str, str]]:
        """Every (field, message) of a choice this installation cannot serve; [] when none."""

    def load_instances(self, cfg: RunConfig) -> list[int]:
        """`TaskInstance` row ids the run cycles through (rows created as needed)."""

    def setup_engines(self, run_id: int, cfg: RunConfig, shared_with: list[int]) -> None:
        """Put the engines on the weights the run starts from (checkpoint or base).

        `shared_with`: ids of other running runs that use the same engines; their weights must
        not be replaced under them.
        """

    def prepare(self, record: dict, episode_id: int, cfg: RunConfig) -> dict:
        """Build the episode's runtime; returns its JSON state (stored on the episode)."""

    def release(self, runtime: dict) -> None:
        """Delete a runtime (idempotent)."""

    def rollout(self, claim: Claim, token: str, cancelled: Callable[[], bool]) -> HarnessOutcome:
        """Run the episode's agent with the session `token` as its API key."""

    def grade(self, record: dict, patch: str, episode_id: int, cfg: RunConfig) -> GradeOutcome:
        """Grade the patch (and build trajectories for train/collect runs)."""

    def forfeit(self, record: dict, episode_id: int, cfg: RunConfig, forfeit: dict) -> GradeOutcome:
        """Score an episode that its own actions ended (`forfeit_record`) with reward 0, ungraded,
        and build its trajectories for train/collect runs as `grade` does."""

    def train(self, run_id: int, step: int, episode_ids: list[int] | None = None) -> dict:
        """Run training step `step` of the run; returns its metrics (with `policy_version`)."""
