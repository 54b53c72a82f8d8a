"""A vLLM pause never outlives its weight update: the reloader resumes the server when the load
fails or hangs past its deadline, and the watchdog resumes a server whose recorded pause nobody
ended (a reloader killed mid-update, a failed `/resume`).

Against `support.fake_vllm.FakeVLLM`, a real HTTP server answering vLLM 0.32's pause routes, not
vLLM itself: the one CPU vLLM of the suite (tests/vllm) is shared by every test of that folder and
cannot be made to fail or hang a load on cue, or lose its reloader half-way, without breaking the
others.  Real Redis throughout.  The pause/keep contract on real vLLM is in
tests/vllm/test_vllm_contract.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from app import config, weight_gate
from app.config import ROOT
from app.control.engine_pauses import resume_stale_pauses
from app.engines.vllm import VLLMReloader
from app.engines.vllm.reload import VLLMReloadError
from support.fake_vllm import FakeVLLM

REDIS_DB = 10


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def reload(url: str, version: int = 1, **kwargs):
    reloader = VLLMReloader(url, **kwargs)
    try:
        return reloader.reload("/nowhere/step_0/model", version, mode="keep", recompute_kv=True)
    finally:
        reloader.close()


def test_a_clean_update_pauses_loads_resumes_and_forgets_its_pause(redis_db, fake):
    receipt = reload(fake.url)
    assert receipt["paused"] is True and receipt["mode"] == "keep"
    assert [path for _, path in fake.calls] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert fake.pause_params == [{"mode": "keep", "clear_cache": "true"}]
    assert not fake.paused and weight_gate.recorded_pauses() == {}
    assert [v for v, _ in weight_gate.recorded_updates(fake.url)] == [1]


def test_a_failed_load_resumes_the_server_on_the_old_weights(redis_db):
    fake = FakeVLLM(load="fail")
    try:
        with pytest.raises(VLLMReloadError, match=r"^load: /collective_rpc answered 500: turnstile_load_weights"):
            reload(fake.url)
        assert [path for _, path in fake.calls] == ["/pause", "/collective_rpc", "/resume"]
        assert not fake.paused and weight_gate.recorded_pauses() == {}
        assert weight_gate.recorded_updates(fake.url) == []  # no update happened: nothing to split streams at
    finally:
        fake.close()


def test_a_hung_load_is_given_up_at_the_deadline_and_the_server_resumed(redis_db):
    """The load never answers: at the reloader's deadline it stops waiting and resumes the server
    while the load is still hanging there; vLLM is told the same deadline (`timeout` of its
    collective_rpc, which frees its engine core for the resume)."""
    fake = FakeVLLM(load="hang")
    try:
        with pytest.raises(VLLMReloadError, match=r"^load: /collective_rpc did not answer within 1 s"):
            reload(fake.url, pause_timeout_s=1.0)
        assert not fake.release.is_set()  # the load is still hanging: the resume did not wait for it
        assert fake.calls[-1] == ("POST", "/resume") and not fake.paused
        assert 0 < fake.rpc_bodies[0]["timeout"] <= 1.0
        assert weight_gate.recorded_pauses() == {}
    finally:
        fake.close()


def test_a_failed_resume_is_left_to_the_watchdog_which_resumes_the_server(redis_db):
    """The load fails and so does the first `/resume`: the caller sees the load's error, the pause
    record stays, and the watchdog's check resumes the server once the record is past the
    timeout (not before)."""
    fake = FakeVLLM(load="fail", resume_failures=1)
    try:
        with pytest.raises(VLLMReloadError, match=r"^load:"):
            reload(fake.url)
        assert fake.paused and fake.resumes() == 1
        (version, paused_at, _), = weight_gate.recorded_pauses().values()
        assert version == 1
        timeout = config.get_settings().weight_pause_timeout_s
        assert resume_stale_pauses(now=paused_at + timeout - 1) == {}  # its reloader's deadline is not past
        assert fake.paused and fake.resumes() == 1
        assert resume_stale_pauses(now=paused_at + timeout + 1) == {fake.url: "resumed"}
        assert not fake.paused and fake.resumes() == 2
        assert weight_gate.recorded_pauses() == {}
        assert resume_stale_pauses(now=paused_at + timeout + 1) == {}  # nothing left to resume
    finally:
        fake.close()


def test_the_watchdog_keeps_an_unreachable_servers_record_and_leaves_a_newer_pause_alone(redis_db, fake):
    dead = "http://127.0.0.1:9"  # discard port: connections are refused at once
    weight_gate.record_pause(dead, 3, 1000.0)
    newer = weight_gate.record_pause(fake.url, 4, 2000.0)
    report = resume_stale_pauses(timeout_s=500.0, now=2100.0)
    assert list(report) == [dead] and report[dead].startswith("error: EngineConnectionError")
    assert set(weight_gate.recorded_pauses()) == {dead, fake.url.rstrip("/")}
    assert fake.calls == []
    # A record replaced by a newer update's between the read and the delete is not deleted.
    assert not weight_gate.clear_pause(fake.url, "4 1999.000000") and weight_gate.clear_pause(fake.url, newer)


def test_a_server_without_pause_loads_without_a_record(redis_db):
    fake = FakeVLLM(pause_routes=False)
    try:
        receipt = reload(fake.url)
        assert receipt["paused"] is False and receipt["mode"] is None
        assert [path for _, path in fake.calls] == ["/pause", "/collective_rpc", "/reset_prefix_cache"]  # 404: no resume
        assert weight_gate.recorded_pauses() == {}
    finally:
        fake.close()


KILLED_RELOADER = """
import sys
from app.engines.vllm import VLLMReloader
VLLMReloader(sys.argv[1], pause_timeout_s=600).reload("/nowhere/model", 7, mode="keep")
"""


def test_a_reloader_killed_mid_update_is_resumed_by_the_watchdog_pass(database, redis_db, monkeypatch, tmp_path):
    """A trainer process killed (SIGKILL) while its load hangs leaves the server paused; the
    watchdog's periodic pass (`control.watchdog`) resumes it once the pause is past
    `weight_pause_timeout_s` and reports it."""
    from app.tasks import control as control_tasks

    fake = FakeVLLM(load="hang")
    try:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_RELOADER, fake.url], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert fake.load_started.wait(120), "the reloader never sent its load"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        assert fake.paused and fake.resumes() == 0
        assert [v for v, _, _ in weight_gate.recorded_pauses().values()] == [7]
        monkeypatch.setenv("TURNSTILE_WEIGHT_PAUSE_TIMEOUT_S", "0.001")
        monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
        config.reset_settings()
        report = control_tasks.watchdog()
        assert report["engines_resumed"] == {fake.url: "resumed"}, report
        assert not fake.paused and fake.resumes() == 1
        assert weight_gate.recorded_pauses() == {}
    finally:
        fake.close()
        config.reset_settings()
