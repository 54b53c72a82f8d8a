"""Episodes with recorded model calls, written straight to the process's database, for the tests of
what is built from the calls (trajectories, ingestion checks, exports)."""
from __future__ import annotations

from typing import Any

from app.db import session_scope
from app.tables import Completion, Episode, Run, TaskInstance


def seed_episode(calls: list[tuple[list[int], list[int], list[float] | None]], *,
                 extra: list[dict[str, Any]] | None = None) -> int:
    """A completed episode (reward 1.0) of a new train run whose completions are `calls`, in order;
    returns its id.

    Args:
        calls: (prompt token ids, sampled token ids, logprobs or None) per model call; call `i` is
            stored as `seq` i with request key `k<i>`, API "chat", finish reason "stop".
        extra: per call, more `Completion` columns (e.g. `normalized_request`); None: none.
    """
    extra = extra or [{}] * len(calls)
    if len(extra) != len(calls):
        raise ValueError(f"{len(extra)} extra column sets for {len(calls)} calls")
    with session_scope() as s:
        run = Run(kind="train", config={})
        inst = TaskInstance(task_set="t", instance_id="x__1", repo="x/x", record={})
        s.add_all([run, inst])
        s.flush()
        ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0, status="completed", reward=1.0)
        s.add(ep)
        s.flush()
        for seq, ((prompt, sampled, logprobs), columns) in enumerate(zip(calls, extra)):
            s.add(Completion(episode_id=ep.id, seq=seq, request_key=f"k{seq}", api="chat", raw_request={},
                             prompt_ids=prompt, sampled_ids=sampled, logprobs=logprobs, finish_reason="stop",
                             **columns))
        return ep.id
