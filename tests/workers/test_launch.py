"""Crash safety of the processes: a worker survives Redis restarts; the launcher restarts a dead process.

Real processes, bounded: a private `redis-server` on a free port (no persistence) that is SIGKILLed and
started again on the same port under a real Celery worker run with the Procfile's options.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from celery import Celery

from support import Proc, free_port, wait_for
from workers.launch import MAX_BACKOFF_S, backoff_s


def _redis(port: int, tmp: Path) -> Proc:
    proc = Proc(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(tmp)], dict(os.environ), tmp / f"redis-{time.monotonic_ns()}.log")
    wait_for(lambda: "Ready to accept connections" in proc.output(), 10, 0.05, "redis-server to start")
    return proc


def test_worker_reconnects_after_redis_restarts_and_keeps_consuming(tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    redis_proc = _redis(port, tmp_path)
    env = {**os.environ, "REDIS_URL": url, "CELERY_BROKER_URL": url, "CELERY_RESULT_BACKEND": url,
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}"}
    # The Procfile's worker options (heartbeat on, gossip and mingle off).
    worker = Proc([sys.executable, "-m", "celery", "-A", "app", "worker", "-Q", "control", "-c", "1",
                   "-n", f"reconnect-{uuid.uuid4().hex[:6]}@%h", "-O", "fair", "--without-gossip",
                   "--without-mingle", "--loglevel", "INFO"], env, tmp_path / "worker.log")
    # Not the current app: Turnstile's shared tasks resolve the current app when they are sent, and
    # later tests in this process would route them through this unconfigured one (queue "celery").
    producer = Celery(broker=url, set_as_current=False)
    producer.conf.update(broker_connection_retry_on_startup=True, broker_transport_options={"sep": ":"})

    def consumed(task_id: str, timeout: float) -> None:
        wait_for(lambda: f"[{task_id}] succeeded" in worker.output(), timeout, 0.1,
                 f"task {task_id} to run\n{worker.output()[-3000:]}")

    def send() -> str:
        return producer.send_task("celery.accumulate", args=[1], queue="control", ignore_result=True).id

    try:
        wait_for(lambda: "ready." in worker.output(), 60, 0.1, f"the worker\n{worker.output()[-3000:]}")
        consumed(send(), 20)
        for restart in range(2):  # the second restart catches workers that reconnect once, then stall
            redis_proc.kill(signal.SIGKILL)
            time.sleep(0.5)
            redis_proc = _redis(port, tmp_path)
            t0 = time.monotonic()
            task_id = send()
            consumed(task_id, 30)
            print(f"restart {restart + 1}: task consumed {time.monotonic() - t0:.1f} s after Redis came back")
        assert worker.popen.poll() is None, "the worker exited"
        assert "Unrecoverable error" not in worker.output()
    finally:
        producer.close()
        worker.kill(signal.SIGTERM)
        redis_proc.kill(signal.SIGKILL)


def test_backoff_doubles_up_to_its_cap():
    assert [backoff_s(n, 1.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_s(20, 1.0) == MAX_BACKOFF_S


def test_launcher_restarts_a_killed_child_and_stops_it_on_sigterm(tmp_path):
    pids = tmp_path / "pids"
    child = ("import os, time; f = open(os.environ['PIDS'], 'a'); f.write(str(os.getpid()) + chr(10)); f.close(); "
             "time.sleep(60)")
    launcher = Proc([sys.executable, "-m", "workers.launch", sys.executable, "-c", child],
                    {**os.environ, "PIDS": str(pids), "TURNSTILE_RESTART_BACKOFF_S": "0.1"}, tmp_path / "launch.log")

    def started() -> list[int]:
        return [int(p) for p in pids.read_text().split()] if pids.exists() else []

    try:
        first = wait_for(started, 30, 0.05, "the first child")[0]
        os.kill(first, signal.SIGKILL)
        t0 = time.monotonic()
        second = wait_for(lambda: started()[1:], 30, 0.05, f"a restarted child\n{launcher.output()}")[0]
        print(f"restarted {time.monotonic() - t0:.2f} s after SIGKILL")
        assert second != first and "exited with status -9" in launcher.output()
        os.kill(launcher.popen.pid, signal.SIGTERM)  # only the launcher: it must pass the signal on
        assert launcher.popen.wait(timeout=15) == 128 + signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            wait_for(lambda: os.kill(second, 0) and False, 5, 0.05, "the child to end")
        assert len(started()) == 2  # not restarted after the stop signal
    finally:
        launcher.kill(signal.SIGKILL)


def test_a_stalled_redis_reads_as_not_cancelled_in_the_rollout_poll_and_a_cancel_is_seen_after(monkeypatch, redis_db):
    """A server that accepts connections and never replies (what a stalled Redis looks like to a
    client: its socket timeout fires) must not end a rollout's cancel poll; the next poll reads
    the real flag."""
    import socket
    import threading

    import redis as redis_lib

    from app.control import redis_state

    stalled = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(stalled.accept()[0]), daemon=True).start()
    silent = redis_lib.Redis(host="127.0.0.1", port=stalled.getsockname()[1], socket_timeout=0.3)
    monkeypatch.setattr(redis_state, "get_redis", lambda: silent)
    with pytest.raises(redis_lib.exceptions.TimeoutError):
        redis_state.is_cancelled(7)  # the plain read still says what happened
    assert redis_state.cancel_polled(7) is False
    monkeypatch.setattr(redis_state, "get_redis", lambda: redis_db)
    redis_db.set(redis_state.cancel_key(7), 1)
    assert redis_state.cancel_polled(7) is True
    stalled.close()
