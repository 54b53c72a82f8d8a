"""What the control loop wants sent next: the return value of every control function.

The control code decides and commits; it never talks to Celery.  It returns a `Plan`,
and the task layer (`app.tasks.send`) sends it after the commit, so a message never
names a row that is not yet visible to the worker that receives it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Plan:
    """Messages to send.  Every list holds ids; `priority` is the run's Celery priority (0 first).

    prepare / rollout / grade: episode ids for those queues.
    train: (run_id, step) training steps for the gpu queue.
    tick: run ids whose tick should run in a `control` worker (used where the caller is not
    itself a control-loop process, e.g. the watchdog ticking every running run).
    start: run ids whose `control.start_run` is (re-)sent (the watchdog, for a run still queued
    long after its creation: its start message was lost; starting is idempotent).
    """

    prepare: list[int] = field(default_factory=list)
    rollout: list[int] = field(default_factory=list)
    grade: list[int] = field(default_factory=list)
    train: list[tuple[int, int]] = field(default_factory=list)
    tick: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    priority: int = 9

    def __bool__(self) -> bool:
        return bool(self.prepare or self.rollout or self.grade or self.train or self.tick or self.start)

    def __iadd__(self, other: "Plan | None") -> "Plan":
        if other is not None:
            self.prepare += other.prepare
            self.rollout += other.rollout
            self.grade += other.grade
            self.train += [t for t in other.train if t not in self.train]
            self.tick += [r for r in other.tick if r not in self.tick]
            self.start += [r for r in other.start if r not in self.start]
            if other:
                self.priority = min(self.priority, other.priority)
        return self


def celery_priority(run_priority: int) -> int:
    """Map a run's priority (0 low .. 9 high) to kombu's Redis priority (0 is served first)."""
    return max(0, min(9, 9 - run_priority))
