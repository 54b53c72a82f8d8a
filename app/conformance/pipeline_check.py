"""`harness check --pipeline`: the check through the real pipeline (REST run -> Celery worker -> sandbox).

For each harness a `collect` run (one instance of the task set, group of 1) is
submitted to the REST API (gunicorn subprocess); a real `celery -A app worker`
prepares the runtime, runs the preset headless in its sandbox (the pipeline's
rollout stage), grades the patch and builds the trajectories.  The
gateway (gunicorn) forwards to the scripted engine in `auto` mode, which answers
each episode with its own harness's check script.  Everything is bound to a
fresh SQLite database and a separate Redis database, so a running deployment
is never touched.

The report per harness: the episode's final status and exit status, completions
captured (with ids), APIs spoken, the pipeline's merge statistics, whether the
scripted edit is in the episode's patch, and the rollout seconds.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from app.auth import auth_header
from app.conformance.harness_check import CHECK_MODEL
from app.conformance.servers import ROOT, Servers, free_port, wait_http
from app.harnesses import get_preset
from app.harnesses.base import CHECK_CONTENT, CHECK_FILE, shared_tools_dir
from app.tables import Base, Completion, Episode, Run
from app.tasksets import load_task_set
from app.transitions import TERMINAL

SECRET_HEADERS = ("authorization", "x-api-key", "x-goog-api-key")


@dataclass
class PipelineReport:
    """One harness's episode as the pipeline recorded it (JSON-able with `as_dict`)."""

    harness: str
    api_expected: str
    run_status: str | None = None
    episode_status: str | None = None
    exit_status: str | None = None
    error: str | None = None
    rollout_seconds: float | None = None
    completions: int = 0
    completions_with_ids: int = 0
    apis: list[str] = field(default_factory=list)
    merge_stats: dict | None = None
    edit_in_patch: bool = False
    credentials_stored: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


class _PipelineServers(Servers):
    """Scripted engine (auto), gateway, REST API and one Celery worker, all on one database and Redis DB."""

    def __init__(self, database_url: str, redis_url: str, workdir: Path, concurrency: int = 2):
        super().__init__("auto", database_url, workdir)
        self.redis_url, self.concurrency = redis_url, concurrency

    def __enter__(self) -> "_PipelineServers":
        super().__enter__()  # engine + gateway (DATABASE_URL set for both)
        try:
            aport = free_port()
            self.api_url = f"http://127.0.0.1:{aport}"
            env = {**os.environ, "DATABASE_URL": self.database_url, "REDIS_URL": self.redis_url,
                   "CELERY_BROKER_URL": self.redis_url, "CELERY_RESULT_BACKEND": self.redis_url,
                   "TURNSTILE_GATEWAY_URL": self.gateway_url, "TURNSTILE_ENGINE_URLS": self.engine_url,
                   "TURNSTILE_TOOLS_DIR": str(shared_tools_dir()), "TURNSTILE_API_BIND": f"127.0.0.1:{aport}",
                   "TURNSTILE_API_WORKERS": "1", "PYTHONUNBUFFERED": "1"}
            proc, log = self.start([sys.executable, "-m", "gunicorn", "-c", str(ROOT / "workers" / "api_conf.py"),
                                    "app:create_app()"], env, "api")
            wait_http(self.api_url + "/api/health", proc, log)
            self.start([sys.executable, "-m", "celery", "-A", "app", "worker", "-Q", "control,prepare,rollout,grade",
                        "-c", str(self.concurrency), "-n", f"check-{aport}@%h", "--without-heartbeat",
                        "--without-mingle", "--without-gossip", "-O", "fair", "--loglevel", "INFO"], env, "worker")
        except BaseException:
            self.__exit__()
            raise
        return self


def run_config(harness: str, instance: str | None, task_set: str, agent_s: int, engine_url: str | None = None) -> dict:
    """The collect run submitted per harness (smallest size: one instance, one episode).

    With `engine_url` (the scripted engine) the run names it as an external engine
    (`model.engine=vllm`: the scripted engine speaks the same token-returning API): its context
    is not the embedded models' 8192 tokens, so the preflight's prompt-fit check, which would
    refuse the harnesses whose prompt exceeds SmolLM2's context, does not apply.
    """
    cfg = {"kind": "collect", "harness": harness, "task_set": task_set, "group_size": 1, "tasks_per_step": 1,
           "steps": 1, "budget": {"max_turns": 8, "max_tokens": 512},
           "timeouts": {"agent_s": agent_s, "grade_s": 300, "prepare_s": 600},
           "scheduling": {"rollout_slots": 1, "ready_depth": 0}}
    if engine_url:
        cfg["model"] = {"engine": "vllm", "name": CHECK_MODEL, "engine_urls": [engine_url]}
    if instance:
        cfg["instances"] = [instance]
    return cfg


def _first_instance(task_set: str) -> str:
    return load_task_set(task_set).instances[0].instance_id


def _evaluate(report: PipelineReport, run: Run | None, ep: Episode | None, rows: list[Completion]) -> None:
    report.run_status = run.status if run else None
    if ep is not None:
        report.episode_status, report.exit_status, report.error = ep.status, ep.exit_status, ep.error
        if ep.started_at and ep.rollout_finished_at:
            report.rollout_seconds = round((ep.rollout_finished_at - ep.started_at).total_seconds(), 2)
        report.merge_stats = ep.merge_stats
        patch = ep.patch or ""
        report.edit_in_patch = f"b/{CHECK_FILE}" in patch and f"+{CHECK_CONTENT}" in patch
    report.completions = len(rows)
    report.apis = sorted({r.api for r in rows})
    report.completions_with_ids = sum(1 for r in rows if r.prompt_ids and r.sampled_ids and r.logprobs is not None
                                      and len(r.logprobs) == len(r.sampled_ids))
    report.credentials_stored = any(
        str(v) != "<redacted>" for r in rows
        for k, v in ((r.raw_request or {}).get("headers") or {}).items() if k.lower() in SECRET_HEADERS)
    p = report.problems
    if report.run_status != "completed":
        p.append(f"run ended {report.run_status!r}")
    if report.episode_status != "completed":
        p.append(f"episode ended {report.episode_status!r}: {report.error}")
    if report.exit_status != "exit 0":
        p.append(f"harness exit status {report.exit_status!r}")
    if report.completions_with_ids == 0:
        p.append("no completion with prompt ids, sampled ids and logprobs")
    if report.apis and report.apis != [report.api_expected]:
        p.append(f"API spoken {report.apis} != {report.api_expected!r}")
    if not report.edit_in_patch:
        p.append(f"the scripted edit of {CHECK_FILE} is not in the episode's patch")
    if report.credentials_stored:
        p.append("a credential header was stored unredacted")


def run_pipeline_checks(names: list[str], *, redis_url: str, task_set: str = "synthetic",
                        instance: str | None = None, timeout_s: float = 600.0, agent_s: int = 120,
                        workdir: Path | None = None) -> list[PipelineReport]:
    """Submit one collect run per harness in `names` and wait for all; returns one report each.

    `redis_url` must name a Redis database no deployment uses (its queues are the
    check's).  Uses a fresh SQLite database under `workdir` (temporary by default).
    Raises RuntimeError when a server does not start or a run is rejected.
    """
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="turnstile-pipeline-check-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{work / 'pipeline-check.db'}"
    engine = create_engine(url)
    instance = instance or _first_instance(task_set)
    try:
        Base.metadata.create_all(engine)
        import redis as redis_lib

        redis_lib.Redis.from_url(redis_url).flushdb()
        with _PipelineServers(url, redis_url, work) as servers:
            run_ids: dict[str, int] = {}
            for name in names:
                resp = httpx.post(servers.api_url + "/api/runs", timeout=30, headers=auth_header(),
                                  json=run_config(name, instance, task_set, agent_s, servers.engine_url))
                if resp.status_code != 202:
                    raise RuntimeError(f"run for {name} rejected ({resp.status_code}): {resp.text[:500]}")
                run_ids[name] = resp.json()["id"]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                with Session(engine) as s:
                    statuses = s.execute(select(Run.status).where(Run.id.in_(run_ids.values()))).scalars().all()
                if all(st in TERMINAL for st in statuses):
                    break
                time.sleep(1.0)
        reports = []
        with Session(engine) as s:
            for name, run_id in run_ids.items():
                run = s.get(Run, run_id)
                ep = s.execute(select(Episode).where(Episode.run_id == run_id)).scalars().first()
                rows = list(s.execute(select(Completion).where(Completion.episode_id == ep.id)
                                      .order_by(Completion.seq)).scalars()) if ep else []
                report = PipelineReport(harness=name, api_expected=get_preset(name).api)
                _evaluate(report, run, ep, rows)
                reports.append(report)
        return reports
    finally:
        engine.dispose()
        if own:
            shutil.rmtree(work, ignore_errors=True)
