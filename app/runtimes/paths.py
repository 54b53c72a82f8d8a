"""Where runtimes keep things on the host, and a cross-process build lock.

  <cache_dir>/sdists/<sha256>/<file>   downloaded sdists, by archive hash
  <cache_dir>/mirrors/<key>.git        bare git mirrors (SWE-bench `git` sources)
  <cache_dir>/bases/<instance>-<key>/  materialized base repository per instance (one commit)
  <cache_dir>/envs/<key>/              virtualenv per (python, install commands, source)
  <var_dir>/runtimes/<id>/             one episode's or grade's runtime: workspace/, home/, ...
  <var_dir>/grading/logs/              grading logs (kept after the runtime is gone)

`cache_dir` is `$TURNSTILE_CACHE_DIR` or `<var_dir>/cache`.  Nothing under these
paths is ever mounted into an agent's sandbox (only the runtime's own workspace
and home, and the env's venv read-only).
"""
from __future__ import annotations

import contextlib
import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from app.config import Settings, get_settings


@dataclass(frozen=True)
class RuntimePaths:
    var_dir: Path
    cache_dir: Path

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "RuntimePaths":
        s = settings or get_settings()
        cache = s.cache_dir or Path(s.var_dir) / "cache"
        return cls(var_dir=Path(s.var_dir).resolve(), cache_dir=Path(cache).resolve())

    @property
    def sdists(self) -> Path:
        return self.cache_dir / "sdists"

    @property
    def mirrors(self) -> Path:
        return self.cache_dir / "mirrors"

    @property
    def bases(self) -> Path:
        return self.cache_dir / "bases"

    @property
    def envs(self) -> Path:
        return self.cache_dir / "envs"

    @property
    def runtimes(self) -> Path:
        return self.var_dir / "runtimes"

    @property
    def grading_logs(self) -> Path:
        return self.var_dir / "grading" / "logs"


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Exclusive `flock` on `path` (created if missing): one builder per cache entry across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
