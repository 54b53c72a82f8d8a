"""Upsert task instances into the `task_instances` table (app.tables.TaskInstance).

Idempotent and safe under concurrency: one INSERT ... ON CONFLICT (task_set,
instance_id) DO UPDATE per record (SQLite >= 3.24 and PostgreSQL both support
it), so two workers loading the same set at once never create duplicates.
"""
from __future__ import annotations

from typing import Any, Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.tables import TaskInstance
from app.tasksets.schema import InstanceRecord


def _insert_for(session: Session):
    name = session.get_bind().dialect.name
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only SQLite and PostgreSQL are supported
        raise NotImplementedError(f"upsert_instances supports sqlite and postgresql, not {name}")
    return insert


def upsert_instances(
    session: Session, task_set: str, records: Iterable[InstanceRecord | dict[str, Any]]
) -> dict[str, int]:
    """Insert or update `records` of `task_set`; returns {instance_id: task_instances.id}.

    `record` is stored as given (a dict is stored unchanged after validation; an
    `InstanceRecord` as `as_swebench()`, the HF string form).  Re-running with the
    same input changes nothing but the stored record.  The caller commits.
    Raises `pydantic.ValidationError` for an invalid dict.
    """
    insert = _insert_for(session)
    ids: list[str] = []
    for rec in records:
        if isinstance(rec, dict):
            model, raw = InstanceRecord.model_validate(rec), rec
        else:
            model, raw = rec, rec.as_swebench()
        stmt = insert(TaskInstance).values(
            task_set=task_set,
            instance_id=model.instance_id,
            repo=model.repo,
            base_commit=(model.base_commit or model.sdist_base_commit or None),
            record=raw,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=["task_set", "instance_id"],
            set_={"repo": stmt.excluded.repo, "base_commit": stmt.excluded.base_commit, "record": stmt.excluded.record},
        )
        session.execute(stmt)
        ids.append(model.instance_id)
    session.flush()
    rows = session.execute(
        select(TaskInstance.instance_id, TaskInstance.id).where(
            TaskInstance.task_set == task_set, TaskInstance.instance_id.in_(ids)
        )
    )
    return {iid: pk for iid, pk in rows}
