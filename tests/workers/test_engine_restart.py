"""An embedded engine killed while a weight update holds it paused comes back serving, through the
Procfile's own restart path: `python -m workers.launch` supervising `gunicorn -c
workers/engine_conf.py`, whose master restarts its worker (the process that owns the model).

The update is in mode `wait`: a long stream runs, so the reload waits for it to drain and the
engine holds every new request (`/health` `reload_pending`, `waiting`).  That is the embedded
engine's pause; a `keep` update copies the weights in one step and is over within milliseconds.
Killed there, the engine restarts on the weights it was started with (version 0, named by its
start spec), which is what the watchdog's engine re-sync looks for (`app.control.engine_resync`).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import psutil
import pytest

from app.engines.client import EngineCallError, EngineClient
from support import free_port, wait_for

MESSAGES = [{"role": "user", "content": "Count to ten."}]


def checkpoint(folder):
    import torch

    from app.engines.modeling import build_tiny_model, save_weights

    model = build_tiny_model(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    save_weights(model, folder, {"policy_version": 1})
    return folder


def gunicorn_pids(launcher_pid: int) -> tuple[int, int] | None:
    """(gunicorn master, its worker) under the launcher, or None while either is not up."""
    masters = psutil.Process(launcher_pid).children()
    workers = masters[0].children() if masters else []
    return (masters[0].pid, workers[0].pid) if masters and workers else None


def caught_paused(url: str, ckpt) -> dict:
    """Start a long stream, then a `wait` reload (it waits for the stream), then a request the
    engine holds; return once `/health` shows the reload pending with a request held."""
    client = EngineClient(url, timeout=600)
    stream = client.chat(MESSAGES, stream=True, max_tokens=4000, ignore_eos=True)
    next(stream)
    outcome: dict = {}

    def call(key, fn):
        try:
            outcome[key] = fn()
        except EngineCallError as exc:
            outcome[key] = exc

    threads = [threading.Thread(target=call, args=("reload", lambda: client.reload(str(ckpt), 1, mode="wait")))]
    threads[0].start()
    wait_for(lambda: client.health()["reload_pending"], 60, 0.02, "the reload to wait for the stream")
    threads.append(threading.Thread(target=call, args=("held", lambda: client.chat(MESSAGES, max_tokens=4))))
    threads[1].start()
    health = wait_for(lambda: (h := client.health())["waiting"] >= 1 and h, 60, 0.02, "the new request to be held")
    assert health["reload_pending"] and health["running"] == 1
    return {"client": client, "stream": stream, "threads": threads, "outcome": outcome}


@pytest.mark.parametrize("kill", ["worker", "gunicorn"])
def test_an_engine_killed_while_a_weight_update_holds_it_paused_comes_back_serving(spawn, tmp_path, kill):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"TURNSTILE_ENGINE_PORT": str(port), "TURNSTILE_ENGINE_MODEL": "tiny", "TURNSTILE_ENGINE_THREADS": "1",
           "TURNSTILE_RESTART_BACKOFF_S": "0.1"}
    launcher = spawn([sys.executable, "-m", "workers.launch", sys.executable, "-m", "gunicorn", "-c",
                      "workers/engine_conf.py"], env, name="engine")
    probe = EngineClient(url, timeout=60)
    try:
        probe.health(wait_s=120)
        master, worker = wait_for(lambda: gunicorn_pids(launcher.popen.pid), 30, what="gunicorn's processes")
        paused = caught_paused(url, checkpoint(tmp_path / "step_0"))

        if kill == "worker":  # the process that owns the model and its scheduler: gunicorn starts another
            psutil.Process(worker).send_signal(signal.SIGKILL)
        else:  # the whole engine, master and worker (its own process group): the launcher starts it again
            os.killpg(master, signal.SIGKILL)
        for thread in paused["threads"]:
            thread.join(120)
        assert isinstance(paused["outcome"]["reload"], EngineCallError), paused["outcome"]
        assert isinstance(paused["outcome"]["held"], EngineCallError), paused["outcome"]
        with pytest.raises(EngineCallError):
            for _ in paused["stream"]:  # the running stream is cut, not finished
                pass
        paused["client"].close()

        def serving_again():
            pids = gunicorn_pids(launcher.popen.pid)
            if pids is None or worker in pids:
                return None
            try:
                return probe.health()
            except (EngineCallError, TimeoutError):  # the new worker is still loading the model
                return None

        health = wait_for(serving_again, 120, 0.1, lambda: f"the engine to serve again\n{launcher.output()[-3000:]}")
        new_master, new_worker = gunicorn_pids(launcher.popen.pid)
        assert new_worker != worker and (new_master == master) == (kill == "worker")
        assert not health["reload_pending"] and health["waiting"] == health["running"] == 0
        assert probe.serving() == (0, "tiny")  # the start weights, as the watchdog's re-sync expects
        answer = probe.chat(MESSAGES, max_tokens=4, ignore_eos=True)
        assert answer["policy_version"] == 0 and answer["choices"][0]["finish_reason"] == "length"
        assert probe.reload(str(tmp_path / "step_0"), 1) == 1  # and takes the update it lost
        if kill == "gunicorn":
            assert "exited with status -9" in launcher.output()
    finally:
        probe.close()
