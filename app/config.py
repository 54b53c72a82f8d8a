"""Settings: every environment variable Turnstile reads, in one typed, strict class.

Every process (api, gateway, engine, workers, the CLI, alembic, gunicorn's config
files) builds its settings here and nowhere else, so one `.env` file or shell
export configures a whole deployment.

Sources, highest priority first:

1. the process environment (`FOO=1 python -m app …` always wins);
2. the `.env` file at the repository root, parsed by python-dotenv;
3. the defaults below.

`.env` format (the only parser of that file is python-dotenv, used by
pydantic-settings): one `KEY=VALUE` per line, an optional leading `export `,
values optionally in single or double quotes (the quotes are stripped; inside
double quotes `\\n` and `${OTHER}` are expanded), `#` starts a comment at the
start of a line or after whitespace following an unquoted value, blank lines
are ignored.  An empty value counts as unset (the default applies).  A key in
`.env` that is not a setting below is an error: nothing else reads that file.

Parsing is strict: a bad integer, boolean (true/false, 1/0, yes/no, on/off),
URL or an out-of-range number raises `SettingsError` (a `ValueError`) naming
the variable, at the first `get_settings()`, instead of silently becoming a
default or failing later.

`python -m app.config` prints every setting as `NAME=value`;
`python -m app.config redis_url` prints one value (shell scripts use it).

Kept whole: one job, the settings class, whose length is its one table of every variable.
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ROOT = Path(__file__).resolve().parent.parent
ENV_FILE = ROOT / ".env"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class SettingsError(ValueError):
    """A setting in the environment or `.env` is invalid; the message names the variable."""


def _env(name: str) -> Any:
    """Field keyword arguments binding a field to environment variable `name` (constructor uses the field name)."""
    return {"validation_alias": AliasChoices(name)}


def _check_url(value: str | None, schemes: set[str] | None, *, host: bool, example: str) -> str | None:
    """`value` if it is a URL with one of `schemes` (any when None) and, if `host`, a host part."""
    if value is None:
        return None
    value = value.strip()
    parts = urlsplit(value)
    ok = bool(parts.scheme) and "://" in value and (schemes is None or parts.scheme.lower() in schemes)
    if ok and host:
        ok = bool(parts.hostname)
    if not ok:
        raise ValueError(f"{value!r} is not a URL like {example}")
    try:
        parts.port  # noqa: B018 - raises on a non-numeric or out-of-range port
    except ValueError:
        raise ValueError(f"{value!r} has an invalid port (a URL like {example})") from None
    return value


_HTTP = {"http", "https"}
_REDIS = {"redis", "rediss", "unix"}


class TinkerQuota(BaseModel):
    """What one Tinker API key may hold at once (`TURNSTILE_TINKER_KEYS`); the service answers a
    request over a limit with a clear error (app.tinker.quotas)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_models: int = Field(4, ge=0, description="Tinker models (LoRA tenants) not yet finished")
    max_sessions: int = Field(16, ge=0, description="SDK sessions heartbeating now")
    max_inflight: int = Field(256, ge=1, description="futures pending or running (more: 429, the SDK backs off)")
    max_request_mb: float = Field(64.0, gt=0, description="one request body, MiB (after zstd decompression)")
    share: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False,
                         description="its models' weight on the trainer beside RL runs and other models "
                                     "(their runs' scheduling.share; app.control.trainer_shares)")


class Settings(BaseSettings):
    """All Turnstile settings. `get_settings()` builds them once per process; tests pass overrides
    as keyword arguments (field names), e.g. `Settings(var_dir=tmp)` or `_env_file=path`."""

    model_config = SettingsConfigDict(
        env_file=ENV_FILE,
        env_file_encoding="utf-8",
        env_ignore_empty=True,   # FOO= (empty) means "use the default"
        extra="forbid",          # an unknown key in .env is a mistake, not something to ignore
        frozen=True,
        validate_by_name=True,   # Settings(var_dir=...) as well as the environment names
        case_sensitive=False,
    )

    # --- where things live ------------------------------------------------------------
    var_dir: Path = Field(ROOT / "var", **_env("TURNSTILE_VAR_DIR"),
                          description="State folder: SQLite database, runs, runtimes, caches, tools, logs.")
    database_url: str = Field(default_factory=lambda data: f"sqlite:///{data['var_dir'] / 'turnstile.db'}",
                              **_env("DATABASE_URL"),
                              description="SQLAlchemy URL of the database "
                                          "(default: SQLite file <TURNSTILE_VAR_DIR>/turnstile.db).")
    sqlite_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", **_env("TURNSTILE_SQLITE_SYNCHRONOUS"),
        description="SQLite's synchronous pragma (https://sqlite.org/pragma.html#pragma_synchronous; the "
                    "database is in WAL mode): NORMAL keeps every commit through a crash of any process and "
                    "fsyncs at checkpoints only; FULL also fsyncs each commit, so a commit survives a power "
                    "loss or an OS crash, at a disk flush per recorded model call.")
    cache_dir: Path | None = Field(None, **_env("TURNSTILE_CACHE_DIR"),
                                   description="Cache of sdists, git mirrors and built environments "
                                               "(default: <TURNSTILE_VAR_DIR>/cache).")
    tools_dir: Path | None = Field(None, **_env("TURNSTILE_TOOLS_DIR"),
                                   description="Shared harness CLI installs (default: <TURNSTILE_VAR_DIR>/tools).")
    task_dirs: Annotated[list[Path], NoDecode] = Field(
        [], **_env("TURNSTILE_TASK_DIRS"),
        description="Comma-separated folders a run's `task_set` path may point into, besides the bundled "
                    "data/tasks and <TURNSTILE_VAR_DIR>/tasks; any other path is refused.")
    task_set_max_bytes: int = Field(256 * 1024 * 1024, ge=1, **_env("TURNSTILE_TASK_SET_MAX_BYTES"),
                                    description="Largest task set file (or folder, all files together) loaded, in bytes.")
    task_set_max_records: int = Field(100_000, ge=1, **_env("TURNSTILE_TASK_SET_MAX_RECORDS"),
                                      description="Most task instances one task set may hold.")

    # --- Redis / Celery ---------------------------------------------------------------
    redis_url: str = Field("redis://localhost:6379/0", **_env("REDIS_URL"),
                           description="Redis: Celery broker and result backend by default, READY buffers, "
                                       "locks, caches (use maxmemory-policy noeviction).")
    broker_url: str = Field(default_factory=lambda data: data["redis_url"], **_env("CELERY_BROKER_URL"),
                            description="Celery broker URL (default: REDIS_URL).")
    result_backend: str = Field(default_factory=lambda data: data["redis_url"], **_env("CELERY_RESULT_BACKEND"),
                                description="Celery result backend URL (default: REDIS_URL).")
    # Longest a single Celery task may run (seconds).  An episode is bounded by its own
    # agent budget; this is the hard ceiling above every stage.
    task_soft_time_limit: int = Field(3600, gt=0, **_env("TURNSTILE_TASK_SOFT_TIME_LIMIT"),
                                      description="Celery soft time limit of every task, seconds.")
    task_time_limit: int = Field(default_factory=lambda data: data["task_soft_time_limit"] + 120, gt=0,
                                 **_env("TURNSTILE_TASK_TIME_LIMIT"),
                                 description="Celery hard time limit, seconds; must be above the soft limit "
                                             "(default: soft limit + 120).")
    # Redis redelivers an unacked task after this many seconds; it must be above the
    # longest task or a running episode would be started twice.
    visibility_timeout: int = Field(default_factory=lambda data: max(4 * 3600, data["task_time_limit"] * 2), gt=0,
                                    **_env("TURNSTILE_VISIBILITY_TIMEOUT"),
                                    description="Redis visibility timeout, seconds "
                                                "(default: max(4 h, 2 x TURNSTILE_TASK_TIME_LIMIT)).")
    max_redeliveries: int = Field(3, ge=0, **_env("TURNSTILE_MAX_REDELIVERIES"),
                                  description="How often an episode stage whose lease expired (its worker or its "
                                              "message lost) is re-dispatched before the episode fails.")
    restart_backoff_s: float = Field(1.0, gt=0, le=30, allow_inf_nan=False, **_env("TURNSTILE_RESTART_BACKOFF_S"),
                                     description="First wait before `workers.launch` restarts a Procfile process "
                                                 "that exited (doubles per quick successive exit, at most 30 s).")
    log_level: LogLevel = Field("INFO", **_env("TURNSTILE_LOG_LEVEL"),
                                description="Log level of every process: DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    cpu_concurrency: int = Field(3, ge=1, **_env("TURNSTILE_CPU_CONCURRENCY"),
                                 description="Processes of the `worker` (control, prepare, grade queues).")
    rollout_concurrency: int = Field(8, ge=1, **_env("TURNSTILE_ROLLOUT_CONCURRENCY"),
                                     description="Processes of the `rollout` worker (harness episodes at once).")
    rollout_capacity: int = Field(default_factory=lambda data: data["rollout_concurrency"], ge=1,
                                  **_env("TURNSTILE_ROLLOUT_CAPACITY"),
                                  description="Episodes all rollout workers of the deployment run at once (default: "
                                              "TURNSTILE_ROLLOUT_CONCURRENCY, one rollout host); runs that want "
                                              "rollouts at the same time share it by their scheduling.share.")
    # Stage leases (app.control.lease): a killed worker's episode is re-dispatched at most
    # lease_ttl_s + watchdog_interval_s after its last renewal.
    lease_ttl_s: float = Field(30.0, gt=0, allow_inf_nan=False, **_env("TURNSTILE_LEASE_TTL_S"),
                               description="Seconds an episode stage's lease lasts past its last renewal; the "
                                           "watchdog re-dispatches a stage whose lease expired.")
    lease_renew_s: float | None = Field(None, gt=0, allow_inf_nan=False, **_env("TURNSTILE_LEASE_RENEW_S"),
                                        description="Seconds between two renewals of a working stage's lease "
                                                    "(default: TURNSTILE_LEASE_TTL_S / 3).")
    watchdog_interval_s: float = Field(30.0, gt=0, allow_inf_nan=False, **_env("TURNSTILE_WATCHDOG_INTERVAL_S"),
                                       description="Seconds between two watchdog passes of `beat` (lost steps, "
                                                   "expired leases, Redis state rebuilt from SQL).")
    flower_port: int = Field(5555, ge=1, le=65535, **_env("TURNSTILE_FLOWER_PORT"),
                             description="Port of the Flower dashboard (bound to 127.0.0.1).")
    tensorboard_port: int = Field(6006, ge=1, le=65535, **_env("TURNSTILE_TENSORBOARD_PORT"),
                                  description="Port of TensorBoard over var/tensorboard (bound to 127.0.0.1; `make up`).")
    tensorboard_url: str | None = Field(None, pattern=r"^https?://\S+$", **_env("TURNSTILE_TENSORBOARD_URL"),
                                        description="TensorBoard's address as a browser reaches it (e.g. "
                                                    "http://127.0.0.1:6006 where `make up` runs): the dashboard "
                                                    "links each run to it; unset, it says so instead.")
    flower_url: str | None = Field(None, pattern=r"^https?://\S+$", **_env("TURNSTILE_FLOWER_URL"),
                                   description="Flower's address as a browser reaches it (e.g. http://127.0.0.1:5555 "
                                               "where `make up` runs): the dashboard links to it; unset, it says so.")
    wandb_mode: Literal["disabled", "offline", "online"] = Field(
        "disabled", **_env("TURNSTILE_WANDB_MODE"),
        description="Weights & Biases logging of every run's metrics: disabled, offline (files under "
                    "var/runs/<id>/wandb, `wandb sync` later; no network needed) or online (needs WANDB_API_KEY).")
    wandb_project: str = Field("turnstile", min_length=1, **_env("TURNSTILE_WANDB_PROJECT"),
                               description="Weights & Biases project the runs are logged to.")

    # --- REST API -----------------------------------------------------------------------
    api_url: str = Field("http://127.0.0.1:8000", **_env("TURNSTILE_API_URL"),
                         description="Where the CLI and other processes reach the REST API.")
    api_bind: str = Field("127.0.0.1:8000", **_env("TURNSTILE_API_BIND"),
                          description="gunicorn bind address of the REST API (host:port or unix:path).")
    api_workers: int = Field(4, ge=1, **_env("TURNSTILE_API_WORKERS"),
                             description="gunicorn worker processes of the REST API (one thread each).")
    api_token: SecretStr | None = Field(None, **_env("TURNSTILE_API_TOKEN"),
                                        description="Bearer token of the REST API, the dashboard and the engines' "
                                                    "admin routes (at least 16 characters; default: the contents of "
                                                    "<TURNSTILE_VAR_DIR>/api_token, generated with mode 0600 on "
                                                    "first use; `python -m app token` prints it).")

    # --- gateway ------------------------------------------------------------------------
    gateway_url: str = Field("http://127.0.0.1:8100", **_env("TURNSTILE_GATEWAY_URL"),
                             description="Base URL harnesses are given for model calls (the gateway).")
    gateway_bind: str = Field("127.0.0.1:8100", **_env("TURNSTILE_GATEWAY_BIND"),
                              description="gunicorn bind address of the gateway (host:port or unix:path).")
    gateway_workers: int = Field(2, ge=1, **_env("TURNSTILE_GATEWAY_WORKERS"),
                                 description="gunicorn worker processes of the gateway.")
    gateway_threads: int = Field(64, ge=1, **_env("TURNSTILE_GATEWAY_THREADS"),
                                 description="Threads per gthread gateway worker (each streamed answer holds one); "
                                             "a gevent worker serves up to 1000 connections (gunicorn's "
                                             "worker_connections).")
    gateway_worker_class: Literal["gthread", "gevent"] = Field(
        "gevent", **_env("TURNSTILE_GATEWAY_WORKER_CLASS"),
        description="gunicorn worker class of the gateway: gevent (one thread, a greenlet per connection; "
                    "less CPU per streamed token from 16 sessions on, bench/gateway.py --token-rate) or "
                    "gthread (a thread per request).")
    gateway_worker_timeout: int = Field(0, ge=0, **_env("TURNSTILE_GATEWAY_WORKER_TIMEOUT"),
                                        description="gunicorn worker timeout of the gateway, seconds (0: none; "
                                                    "keep-alive frames feed the clients' idle timers).")
    gateway_access_log: str | None = Field(None, **_env("TURNSTILE_GATEWAY_ACCESS_LOG"),
                                           description="gunicorn access log of the gateway ('-': stdout; "
                                                       "unset: none).")
    gateway_default_max_tokens: int = Field(4096, ge=1, **_env("TURNSTILE_GATEWAY_DEFAULT_MAX_TOKENS"),
                                            description="Completion token limit when the client sends none.")
    gateway_max_body_bytes: int = Field(32 * 1024 * 1024, ge=1, **_env("TURNSTILE_GATEWAY_MAX_BODY_BYTES"),
                                        description="Largest request body the gateway accepts, bytes.")
    gateway_max_decoded_bytes: int = Field(1024 * 1024, ge=1, **_env("TURNSTILE_GATEWAY_MAX_DECODED_BYTES"),
                                           description="Largest value the gateway decodes from inside a request "
                                                       "(a reasoning signature's text), bytes.")
    gateway_max_prompt_bytes: int | None = Field(None, ge=1, **_env("TURNSTILE_GATEWAY_MAX_PROMPT_BYTES"),
                                                 description="Largest engine request the gateway builds from one "
                                                             "request (its messages, tools and options as JSON, "
                                                             "expanded history included), bytes (unset: the body "
                                                             "cap).")
    gateway_keepalive_s: float = Field(10.0, gt=0, allow_inf_nan=False, **_env("TURNSTILE_GATEWAY_KEEPALIVE_S"),
                                       description="Keep-alive interval of streamed answers while the engine "
                                                   "prefills, seconds.")
    gateway_stream_interval_ms: float = Field(2.0, ge=0, le=1000, allow_inf_nan=False,
                                              **_env("TURNSTILE_GATEWAY_STREAM_INTERVAL_MS"),
                                              description="Least time between two writes of one streamed "
                                                          "answer while its tokens come faster, milliseconds: "
                                                          "what arrives meanwhile goes out in one write (0: "
                                                          "write every engine read at once).")
    gateway_vision: bool = Field(False, **_env("TURNSTILE_GATEWAY_VISION"),
                                 description="The engine's model accepts images (else images become "
                                             "text placeholders).")
    gateway_session_cache_s: float = Field(2.0, ge=0, allow_inf_nan=False,
                                           **_env("TURNSTILE_GATEWAY_SESSION_CACHE_S"),
                                           description="How long a resolved session token is trusted "
                                                       "in-process, seconds.")
    gateway_upstream_timeout_s: float = Field(900.0, gt=0, allow_inf_nan=False,
                                              **_env("TURNSTILE_GATEWAY_UPSTREAM_TIMEOUT_S"),
                                              description="Read timeout of one engine call, seconds.")

    # --- inference engines --------------------------------------------------------------
    engine_urls: Annotated[list[str], NoDecode] = Field(["http://127.0.0.1:8200"], min_length=1,
                                                        **_env("TURNSTILE_ENGINE_URLS"),
                                                        description="Comma-separated engine base URLs; the "
                                                                    "gateway routes each session to one.")
    engine_model: str = Field("smollm2", min_length=1, **_env("TURNSTILE_ENGINE_MODEL"),
                              description="Model the embedded engine serves: tiny | smollm2 | a checkpoint folder.")
    engine_port: int = Field(8200, ge=1, le=65535, **_env("TURNSTILE_ENGINE_PORT"),
                             description="Port of the embedded engine (`python -m app.engines.embedded.server`).")
    engine_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", **_env("TURNSTILE_ENGINE_DTYPE"),
        description="Parameter dtype the embedded engine serves in: float32 (the trainer's own numerics; "
                    "logprob parity is specified in fp32) | bfloat16 (an inference engine's precision: trainer "
                    "weights are cast into it on every load, logprobs are fp32 log-softmax of the bf16 logits).")
    engine_threads: int = Field(1, ge=1, **_env("TURNSTILE_ENGINE_THREADS"),
                                description="torch intra-op threads of the embedded engine (raise only where "
                                            "the engine owns its cores).")
    trainer_threads: int | None = Field(
        None, ge=1, **_env("TURNSTILE_TRAINER_THREADS"),
        description="torch intra-op threads of the trainer and of a local OPD teacher on CPU (app.training.threads); default: the cores left "
                    "after the embedded engine's threads and one core for the rollouts (harnesses, grading), at least "
                    "1.  More threads than free cores slow each step down (every parallel region waits for its "
                    "slowest thread).")
    engine_script: Path | None = Field(None, **_env("TURNSTILE_SCRIPT"),
                                       description="Reply script (JSON) of the scripted test engine "
                                                   "(`python -m app.conformance.scripted`).")
    weight_transfer: Literal["auto", "path", "push"] = Field(
        "auto", **_env("TURNSTILE_WEIGHT_TRANSFER"),
        description="How a new checkpoint reaches an embedded engine: `path` (the engine reads the trainer's "
                    "folder: one machine or a shared volume), `push` (sent over HTTP with SHA-256 digests), "
                    "`auto` (push to an engine whose URL is not a loopback address).")
    weight_pause_timeout_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, **_env("TURNSTILE_WEIGHT_PAUSE_TIMEOUT_S"),
        description="Longest a vLLM engine stays paused for one weight update, seconds: the reloader resumes it "
                    "when the load or the prefix-cache reset takes longer, and the watchdog resumes a server whose "
                    "recorded pause is older (a trainer killed mid-update).")
    host_name: str = Field(default_factory=socket.gethostname, min_length=1,
                           max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", **_env("TURNSTILE_HOST_NAME"),
                           description="This machine's name in per-host Celery queues: a runtime prepared here is "
                                       "rolled out from `rollout.<name>` (default: the hostname).")
    reach_timeout_s: float = Field(60.0, ge=0, allow_inf_nan=False, **_env("TURNSTILE_REACH_TIMEOUT_S"),
                                   description="How long a Celery worker tries at start to reach the database (and, "
                                               "for rollout, the gateway) on another machine before it exits "
                                               "naming the address.")

    # --- task runtimes ------------------------------------------------------------------
    pip_index_url: str | None = Field(None, **_env("PIP_INDEX_URL"),
                                      description="Package index for sdist downloads and environment builds "
                                                  "(default: pip's configuration, else https://pypi.org/simple).")
    pip_cache_dir: Path | None = Field(None, **_env("PIP_CACHE_DIR"),
                                       description="pip cache shared by environment builds (default: ~/.cache/pip).")
    pyenv_root: Path | None = Field(None, **_env("PYENV_ROOT"),
                                    description="pyenv root searched for task Python versions (also ~/.pyenv).")

    # --- image runtimes (app/runtimes/images.py, oci.py) --------------------------------
    image_cache_bytes: int = Field(50 * 1024 ** 3, ge=1, **_env("TURNSTILE_IMAGE_CACHE_BYTES"),
                                   description="Disk the unpacked image cache (<cache>/images/rootfs) may use, bytes; "
                                               "least recently used images not in use are removed past it.")
    image_tls_verify: bool = Field(True, **_env("TURNSTILE_IMAGE_TLS_VERIFY"),
                                   description="Verify registry TLS when pulling images (loopback registries "
                                               "127.0.0.1/localhost are always pulled without TLS).")
    image_pull_timeout_s: int = Field(3600, ge=1, **_env("TURNSTILE_IMAGE_PULL_TIMEOUT_S"),
                                      description="Longest one image pull (skopeo copy) or unpack may take, seconds.")

    # --- sandbox limits (per episode command; app/runtimes/sandbox.py) -------------------
    sandbox_max_processes: int = Field(512, ge=8, **_env("TURNSTILE_SANDBOX_MAX_PROCESSES"),
                                       description="Most processes (threads included) one sandboxed command may "
                                                   "hold at once (cgroup pids.max; RLIMIT_NPROC where there is no "
                                                   "writable cgroup and the worker is not root).")
    sandbox_memory_mb: int = Field(4096, ge=64, **_env("TURNSTILE_SANDBOX_MEMORY_MB"),
                                   description="Memory of one sandboxed command, all its processes and tmpfs files "
                                               "together, MiB (cgroup memory limit; also each process's RLIMIT_DATA).")
    sandbox_tmpfs_mb: int = Field(1024, ge=1, **_env("TURNSTILE_SANDBOX_TMPFS_MB"),
                                  description="Size of each tmpfs inside the sandbox (/, /tmp, /dev/shm), MiB.")
    sandbox_disk_mb: int = Field(8192, ge=16, **_env("TURNSTILE_SANDBOX_DISK_MB"),
                                 description="Disk an episode's workspace and scratch HOME may use together, MiB "
                                             "(checked every few seconds; the command is killed when over).")

    # --- conformance checks -------------------------------------------------------------
    check_redis_url: str | None = Field(None, **_env("TURNSTILE_CHECK_REDIS_URL"),
                                        description="Redis DB of `python -m app harness check-pipeline` "
                                                    "(default: DB 15 of REDIS_URL).")

    # --- the Tinker service (app.tinker) --------------------------------------------------
    tinker_bind: str = Field("127.0.0.1:8300", **_env("TURNSTILE_TINKER_BIND"),
                             description="gunicorn bind address of the Tinker service (the SDK's base_url).")
    tinker_workers: int = Field(2, ge=1, **_env("TURNSTILE_TINKER_WORKERS"),
                                description="gunicorn worker processes of the Tinker service.")
    tinker_keys: dict[str, TinkerQuota] = Field(
        {"default": TinkerQuota()}, **_env("TURNSTILE_TINKER_KEYS"),
        description='Tinker API keys by name, with their quotas, as JSON: {"alice": {"max_models": 2}, "bob": {}}. '
                    "A key's secret is derived from the API token (`turnstile token --tinker NAME` prints it).")
    tinker_sdk_versions: Annotated[list[str], NoDecode] = Field(
        ["0.38.0"], min_length=1, **_env("TURNSTILE_TINKER_SDK_VERSIONS"),
        description="tinker SDK versions the service accepts (comma-separated); another gets a 400 naming these.")
    tinker_base_models: Annotated[list[str], NoDecode] = Field(
        ["smollm2", "tiny"], min_length=1, **_env("TURNSTILE_TINKER_BASE_MODELS"),
        description="base models a Tinker model may be created on (comma-separated model specs the trainer loads).")
    tinker_lora_ranks: Annotated[list[int], NoDecode] = Field(
        [1, 2, 4, 8, 16, 32, 64], min_length=1, **_env("TURNSTILE_TINKER_LORA_RANKS"),
        description="LoRA ranks a Tinker model may have (comma-separated).")
    tinker_pending_timeout_s: float = Field(
        3600.0, gt=0, allow_inf_nan=False, **_env("TURNSTILE_TINKER_PENDING_TIMEOUT_S"),
        description="a Tinker future no worker started within this many seconds is failed by the reaper.")
    tinker_session_timeout_s: float = Field(
        120.0, gt=0, allow_inf_nan=False, **_env("TURNSTILE_TINKER_SESSION_TIMEOUT_S"),
        description="a Tinker session with no heartbeat for this long no longer counts against its key's quota "
                    "(the SDK beats every 10 s).")
    trainer_share_window_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, **_env("TURNSTILE_TRAINER_SHARE_WINDOW_S"),
        description="the trainer seconds each run used over this many seconds decide whose Tinker op goes next "
                    "when runs wait for the trainer (app.control.trainer_shares; weights: scheduling.share).")

    # --- validation -----------------------------------------------------------------------
    @field_validator("var_dir")
    @classmethod
    def _resolve(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("cache_dir", "tools_dir", "pip_cache_dir", "pyenv_root")
    @classmethod
    def _resolve_optional(cls, value: Path | None) -> Path | None:
        return value.expanduser().resolve() if value is not None else None

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("tinker_sdk_versions", "tinker_base_models", "tinker_lora_ranks", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("task_dirs", mode="before")
    @classmethod
    def _split_dirs(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("task_dirs")
    @classmethod
    def _resolve_dirs(cls, value: list[Path]) -> list[Path]:
        return [p.expanduser().resolve() for p in value]

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("api_token")
    @classmethod
    def _token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        secret = value.get_secret_value().strip()
        if len(secret) < 16 or any(c.isspace() or not c.isprintable() for c in secret):
            raise ValueError("must be at least 16 printable characters without spaces")
        return SecretStr(secret)

    @field_validator("database_url")
    @classmethod
    def _database(cls, value: str) -> str:
        return _check_url(value, None, host=False, example="sqlite:///var/turnstile.db or "
                                                          "postgresql+psycopg://user@host:5432/turnstile")

    @field_validator("redis_url", "check_redis_url")
    @classmethod
    def _redis(cls, value: str | None) -> str | None:
        return _check_url(value, _REDIS, host=False, example="redis://localhost:6379/0")

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _celery(cls, value: str) -> str:
        return _check_url(value, None, host=False, example="redis://localhost:6379/0")

    @field_validator("api_url", "gateway_url", "pip_index_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        return _check_url(value, _HTTP, host=True, example="http://127.0.0.1:8000")

    @field_validator("engine_urls")
    @classmethod
    def _http_list(cls, value: list[str]) -> list[str]:
        return [_check_url(v, _HTTP, host=True, example="http://127.0.0.1:8200") for v in value]

    @model_validator(mode="after")
    def _limits(self) -> "Settings":
        if self.lease_renew_s is not None and self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError("TURNSTILE_LEASE_RENEW_S must be below TURNSTILE_LEASE_TTL_S "
                             f"({self.lease_renew_s} >= {self.lease_ttl_s})")
        if self.task_time_limit <= self.task_soft_time_limit:
            raise ValueError("TURNSTILE_TASK_TIME_LIMIT must be above TURNSTILE_TASK_SOFT_TIME_LIMIT "
                             f"({self.task_time_limit} <= {self.task_soft_time_limit})")
        return self

    @classmethod
    def from_env(cls, **overrides: Any) -> "Settings":
        """Settings from the environment and `.env`; a bad value raises `SettingsError` naming it."""
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise SettingsError(_describe(exc)) from None


def env_name(field: str) -> str:
    """The environment variable of settings field `field` (e.g. "redis_url" -> "REDIS_URL")."""
    alias = Settings.model_fields[field].validation_alias
    return alias.choices[0] if isinstance(alias, AliasChoices) else field.upper()


def _describe(exc: ValidationError) -> str:
    names = {f.lower(): env_name(f) for f in Settings.model_fields}
    names.update({env_name(f).lower(): env_name(f) for f in Settings.model_fields})
    problems = []
    for err in exc.errors(include_url=False):
        if err["type"] == "default_factory_not_called":
            continue  # a default derived from a setting that is itself invalid (reported on its own)
        key = str(err["loc"][0]) if err["loc"] else ""
        name = names.get(key.lower(), key.upper())
        if err["type"] == "extra_forbidden":
            problems.append(f"{name} (in {ENV_FILE.name}) is not a Turnstile setting")
        elif name:
            message = err["msg"].removeprefix("Value error, ")
            shown = "<hidden>" if name == "TURNSTILE_API_TOKEN" else repr(err["input"])  # never echo a secret
            problems.append(f"{name}={shown}: {message}")
        else:
            problems.append(err["msg"].removeprefix("Value error, "))
    return "invalid settings (environment or .env): " + "; ".join(problems)


_settings: Settings | None = None


def get_settings() -> Settings:
    """Process-wide settings (read from the environment and `.env` on first use)."""
    global _settings
    if _settings is None:
        _settings = Settings.from_env()
    return _settings


def reset_settings() -> None:
    """Forget cached settings (tests change the environment between cases)."""
    global _settings
    _settings = None


def _main(argv: list[str]) -> int:
    try:
        settings = get_settings()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fields = argv or list(Settings.model_fields)
    for field in fields:
        if field not in Settings.model_fields:
            print(f"error: no setting {field!r} (python -m app.config lists them)", file=sys.stderr)
            return 2
        value = getattr(settings, field)
        if isinstance(value, list):
            value = ",".join(value)
        text = "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        print(text if argv else f"{env_name(field)}={text}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
