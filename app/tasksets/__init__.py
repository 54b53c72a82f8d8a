"""Task sets: SWE-bench-format instances, validated (`load_task_set`) and stored (`upsert_instances`)."""
from app.tasksets.loader import (
    DEFAULT_TASK_SET,
    NAMED_SETS,
    RecordError,
    TaskSet,
    TaskSetError,
    TaskSetNotFound,
    load_records,
    load_task_set,
    resolve_task_set,
)
from app.tasksets.schema import GitSource, InstanceRecord, PypiSdistSource
from app.tasksets.store import upsert_instances

__all__ = [
    "DEFAULT_TASK_SET", "NAMED_SETS", "RecordError", "TaskSet", "TaskSetError", "TaskSetNotFound",
    "load_records", "load_task_set", "resolve_task_set", "InstanceRecord", "GitSource",
    "PypiSdistSource", "upsert_instances",
]
