"""The Celery instance (`celery -A app worker` finds it here under the name `app`).

Queues, one per resource: `control` (scheduling, cheap), `prepare` (runtimes),
`rollout` (harness episodes, minutes), `grade` (test runs), `gpu` (GRPO steps,
one process that keeps the model resident), `teacher` (distillation teachers scoring chains).  Settings: late ack + reject on worker loss for the
idempotent episode stages, prefetch 1, a visibility timeout above the longest
task, soft and hard time limits, JSON only, explicit task names.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from urllib.parse import urlsplit

import redis.exceptions
from celery import Celery
from celery.signals import celeryd_after_setup, worker_process_init
from kombu import Queue
from kombu.transport import redis as kombu_redis

from app.config import get_settings

QUEUES = ("control", "prepare", "rollout", "grade", "gpu", "teacher")

_settings = get_settings()

app = Celery(
    "turnstile",
    broker=_settings.broker_url,
    backend=_settings.result_backend,
    include=["app.tasks.control", "app.tasks.episodes", "app.tasks.training", "app.tasks.teacher",
             "app.tasks.tinker", "app.tasks.tinker_sample"],
)

app.conf.update(
    task_queues=[Queue(name) for name in QUEUES],
    task_default_queue="control",
    task_routes=(
        "app.celery.route_rollout_to_its_host",  # before the table: a prepared runtime's rollout
        {
        "control.*": {"queue": "control"},
        "prepare.*": {"queue": "prepare"},
        "rollout.*": {"queue": "rollout"},
        "grade.*": {"queue": "grade"},
        "gpu.*": {"queue": "gpu"},
        "teacher.*": {"queue": "teacher"},
        },
    ),
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_track_started=True,
    task_ignore_result=True,
    result_expires=24 * 3600,
    worker_prefetch_multiplier=1,
    worker_send_task_events=True,
    task_send_sent_event=True,
    task_soft_time_limit=_settings.task_soft_time_limit,
    task_time_limit=_settings.task_time_limit,
    # Ten priority levels per queue (kombu's Redis transport serves 0 first):
    # eval runs jump ahead of train runs without preempting running episodes.
    broker_transport_options={
        "visibility_timeout": _settings.visibility_timeout,
        "queue_order_strategy": "priority",
        "priority_steps": list(range(10)),
        "sep": ":",
    },
    task_default_priority=9,
    result_backend_transport_options={"visibility_timeout": _settings.visibility_timeout},
    # A lost broker connection does not cancel the stages running in the pool: each holds its lease
    # in SQL and writes its result there, so it finishes once; its message, left unacked in Redis,
    # comes back after the visibility timeout and finds the stage done (a duplicate does nothing).
    worker_cancel_long_running_tasks_on_connection_loss=False,
    broker_connection_retry_on_startup=True,
    # Reconnect to a restarted Redis for as long as it takes (the default gives up after 100 tries
    # and the worker exits).  Workers run with --without-gossip: the Gossip step is the one
    # ConsumerStep, and restarting it after a lost connection closes its channel through a
    # connection whose client is already gone (kombu's Redis `_connparams` reads
    # `conninfo.hostname` of None: "Unrecoverable error: AttributeError('NoneType' object has no
    # attribute 'hostname')", https://github.com/celery/kombu/issues/582), which kills the worker.
    # Turnstile uses nothing gossip provides (worker-to-worker events, clock sync, elections).
    broker_connection_max_retries=None,
    timezone="UTC",
    beat_schedule={
        "watchdog": {"task": "control.watchdog", "schedule": _settings.watchdog_interval_s,
                     "options": {"expires": _settings.watchdog_interval_s * 0.8}},
    },
    beat_schedule_filename=str(_settings.var_dir / "celerybeat-schedule"),
)


_kombu_connparams = kombu_redis.Channel._connparams


def _connparams_of_an_open_channel(self, asynchronous=False):
    """kombu's Redis `Channel._connparams`, raising a connection error on a closed connection.

    After a lost connection the consumer closes it; closing its channel restores the unacked
    messages (`restore_unacked_once`), and a late ack of a task that outlived the connection goes
    to the same channel: both build a Redis client from `self.connection.client`, which the close
    already set to None, and the AttributeError ("'NoneType' object has no attribute 'hostname'",
    https://github.com/celery/kombu/issues/582) is not a connection error, so it escapes kombu's
    `ignore_errors` and Celery's ack error handling and stops the worker.  As a connection error the
    close and the ack fail quietly; the messages stay in Redis's unacked set and are restored after
    the visibility timeout.
    """
    if self.connection.client is None:
        raise redis.exceptions.ConnectionError("the broker connection of this channel is closed")
    return _kombu_connparams(self, asynchronous)


kombu_redis.Channel._connparams = _connparams_of_an_open_channel


@worker_process_init.connect
def _dispose_inherited_pool(**_kwargs) -> None:
    """Never reuse a pooled DB connection across fork (superset's worker_process_init)."""
    from app.db import dispose_engine

    dispose_engine()


def host_queue(host: str) -> str:
    """The rollout queue of one machine: rollouts of the runtimes prepared on its disk."""
    return f"rollout.{host}"


def route_rollout_to_its_host(name, args, kwargs, options, task=None, **kw):
    """Celery router (`task_routes`): `rollout.run_episode` of an episode whose runtime a prepare
    worker built goes to that machine's queue (`host_queue`), so no other machine claims it: the
    runtime is on that machine's disk only.  A later attempt (`attempts` > 0: the first one was
    lost) builds a fresh runtime wherever it runs, so it goes to the shared `rollout` queue, as do
    episodes without a recorded host.  Every other task falls through to the queue table.
    """
    if name != "rollout.run_episode" or not args:
        return None
    from app.db import session_scope
    from app.tables import Episode

    with session_scope() as s:
        row = s.get(Episode, int(args[0]))
        host = (row.runtime or {}).get("host") if row is not None and row.attempts == 0 else None
    return {"queue": host_queue(host) if host else "rollout"}


@celeryd_after_setup.connect
def _consume_this_hosts_rollouts(sender, instance, **_kwargs) -> None:
    """A worker serving `rollout` also serves this machine's own rollout queue (`host_queue` of
    TURNSTILE_HOST_NAME): the rollouts of the runtimes prepared here (Celery's documented way to
    add a per-worker queue at start, `celeryd_after_setup`)."""
    queues = instance.app.amqp.queues
    if queues.consume_from is not None and "rollout" in queues.consume_from:
        queues.select_add(host_queue(get_settings().host_name))


def _address(url: str) -> tuple[str, int] | None:
    """`(host, port)` of a network URL (default ports of PostgreSQL, MySQL, HTTP(S)); None for a
    file or socket URL (SQLite)."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    defaults = {"postgresql": 5432, "mysql": 3306, "http": 80, "https": 443}
    return parts.hostname, parts.port or defaults.get(parts.scheme.split("+")[0], 0)


def _on_another_machine(host: str) -> bool:
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def unreachable(queues, settings=None) -> str | None:
    """Why a worker serving `queues` cannot work from this machine, or None.

    Checked: the database (every worker) and, for a worker of `rollout`, the gateway its
    harnesses call; each only when it is on another machine (a loopback address starts beside
    the worker, as `make up` starts them).  Each is tried by TCP connect until
    `TURNSTILE_REACH_TIMEOUT_S` passes (a database or gateway that starts a little later is
    waited for).  The answer names the address and its setting.
    """
    settings = settings or get_settings()
    targets = [("the database", _address(settings.database_url), "DATABASE_URL")]
    if "rollout" in queues:
        targets.append(("the gateway", _address(settings.gateway_url), "TURNSTILE_GATEWAY_URL"))
    deadline = time.monotonic() + settings.reach_timeout_s
    for what, address, name in targets:
        if address is None or not _on_another_machine(address[0]):
            continue
        while True:
            try:
                socket.create_connection(address, timeout=min(5.0, max(settings.reach_timeout_s, 0.5))).close()
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    host, port = address
                    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                    return (f"cannot reach {what} at {where} ({name}) from this machine "
                            f"({settings.host_name}) within {settings.reach_timeout_s:g} s: {exc}")
                time.sleep(1.0)
    return None


@celeryd_after_setup.connect
def _exit_unless_reachable(sender, instance, **_kwargs) -> None:
    """A worker that cannot reach its database or gateway stops at start with the address, instead
    of taking tasks it can only fail."""
    queues = instance.app.amqp.queues
    problem = unreachable(list(queues.consume_from or queues))
    if problem:
        raise SystemExit(f"turnstile worker {sender}: {problem}")
