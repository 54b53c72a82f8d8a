"""Fill the shared runtime caches a test's processes will read, from the test's own process.

A test's subprocesses may have no route to the package index (the multi-host test's machines are
network namespaces on a bridge), so what their `prepare` downloads or builds (the sdist under
`<cache>/sdists`, the base repository under `<cache>/bases`, the venv under `<cache>/envs`,
`app.runtimes.paths`) must already be in the cache they share.  A test must not count on an
earlier test having left it there: run alone, in a fresh clone or under another order, the cache
is empty.  `fill_runtime_caches` builds those entries here, where the index is reachable, with
the same code a worker's `prepare` runs (`materialize_base`, `ensure_env`), so a worker finds
them under the same keys and builds nothing.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from app.runtimes import bwrap_available
from app.runtimes.environment import ensure_env
from app.runtimes.materialize import materialize_base
from app.runtimes.paths import RuntimePaths
from app.tasksets import load_task_set


def fill_runtime_caches(task_set: str, instance_ids: list[str], cache_dir: Path) -> list[Path]:
    """Build the sdist, base and venv of each instance of `task_set` under `cache_dir` (each a
    no-op when already cached; file-locked, so a concurrent builder waits).  The venv's layout is
    the one a worker on this box uses (confined when bubblewrap works here), so its key matches.

    Returns the venv folders.  Raises `app.runtimes.errors.RuntimeSetupError` when an entry cannot
    be built (the index unreachable from here too, a hash mismatch), and KeyError for an unknown
    instance."""
    records = load_task_set(task_set).by_id()
    confined = bwrap_available()
    envs = []
    with tempfile.TemporaryDirectory(prefix="turnstile-cache-fill-") as var:
        paths = RuntimePaths(var_dir=Path(var), cache_dir=Path(cache_dir).resolve())
        for instance_id in instance_ids:
            record = records[instance_id]
            envs.append(ensure_env(record, materialize_base(record, paths), paths, confined=confined).root)
    return envs
