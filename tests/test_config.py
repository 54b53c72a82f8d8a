"""Settings: one typed, strict class (app.config) reads every variable; `.env` has one parser."""
from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from dotenv import dotenv_values

from app import config
from app.config import ROOT, Settings, SettingsError, env_name, get_settings

ENV_NAMES = [env_name(f) for f in Settings.model_fields]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A clean slate: no setting in the process environment, `.env` = an empty file under tmp.

    Returns a function writing that `.env`."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    dotenv = tmp_path / ".env"
    dotenv.write_text("")
    monkeypatch.setitem(Settings.model_config, "env_file", dotenv)
    config.reset_settings()

    def write(text: str) -> Path:
        dotenv.write_text(text)
        config.reset_settings()
        return dotenv

    yield write
    config.reset_settings()


def test_defaults_and_derived_values(env):
    s = get_settings()
    assert s.var_dir == ROOT / "var"
    assert s.database_url == f"sqlite:///{ROOT / 'var' / 'turnstile.db'}"
    assert s.broker_url == s.result_backend == s.redis_url == "redis://localhost:6379/0"
    assert (s.task_soft_time_limit, s.task_time_limit, s.visibility_timeout) == (3600, 3720, 4 * 3600)
    assert s.engine_urls == ["http://127.0.0.1:8200"] and s.engine_dtype == "float32"
    assert s.log_level == "INFO" and s.gateway_vision is False and s.cache_dir is None
    assert all(field.description for field in Settings.model_fields.values())


def test_derived_defaults_follow_their_sources(env, monkeypatch):
    monkeypatch.setenv("TURNSTILE_VAR_DIR", "/tmp/turnstile-var")
    monkeypatch.setenv("REDIS_URL", "redis://cache:6380/2")
    monkeypatch.setenv("TURNSTILE_TASK_SOFT_TIME_LIMIT", "10000")
    monkeypatch.setenv("TURNSTILE_ENGINE_URLS", "http://a:8200, http://b:8200,")
    monkeypatch.setenv("TURNSTILE_LOG_LEVEL", "debug")
    monkeypatch.setenv("TURNSTILE_API_WORKERS", "")  # empty: the default
    s = get_settings()
    assert s.database_url == "sqlite:////tmp/turnstile-var/turnstile.db"
    assert s.broker_url == s.result_backend == "redis://cache:6380/2"
    assert (s.task_time_limit, s.visibility_timeout) == (10120, 20240)
    assert s.engine_urls == ["http://a:8200", "http://b:8200"]
    assert s.log_level == "DEBUG" and s.api_workers == 4


@pytest.mark.parametrize(("name", "value", "says"), [
    ("TURNSTILE_GATEWAY_WORKERS", "four", "valid integer"),
    ("TURNSTILE_MAX_REDELIVERIES", "2.5", "valid integer"),
    ("TURNSTILE_GATEWAY_VISION", "maybe", "valid boolean"),
    ("TURNSTILE_GATEWAY_KEEPALIVE_S", "-1", "greater than 0"),
    ("REDIS_URL", "localhost:6379", "not a URL"),
    ("TURNSTILE_ENGINE_URLS", "http://a:8200,b:8200", "not a URL"),
    ("TURNSTILE_API_URL", "http://host:port", "invalid port"),
    ("TURNSTILE_LOG_LEVEL", "loud", "INFO"),
    ("TURNSTILE_ENGINE_DTYPE", "float16", "bfloat16"),
])
def test_a_bad_value_raises_naming_the_variable(env, monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as info:
        get_settings()
    message = str(info.value)
    assert f"{name}=" in message and says in message
    assert isinstance(info.value, ValueError)


def test_a_bad_value_in_dotenv_raises_the_same_way(env):
    env("TURNSTILE_GATEWAY_VISION=sometimes\n")
    with pytest.raises(SettingsError, match="TURNSTILE_GATEWAY_VISION='sometimes'"):
        get_settings()


def test_time_limits_are_checked_together(env, monkeypatch):
    monkeypatch.setenv("TURNSTILE_TASK_SOFT_TIME_LIMIT", "600")
    monkeypatch.setenv("TURNSTILE_TASK_TIME_LIMIT", "600")
    with pytest.raises(SettingsError, match="TURNSTILE_TASK_TIME_LIMIT must be above TURNSTILE_TASK_SOFT_TIME_LIMIT"):
        get_settings()


def test_dotenv_format_export_quotes_and_comments(env):
    path = env(
        "# Turnstile\n"
        "\n"
        "export TURNSTILE_ENGINE_PORT=8300\n"
        'TURNSTILE_ENGINE_MODEL="tiny"\n'
        "TURNSTILE_GATEWAY_WORKERS=5 # five workers\n"
        "TURNSTILE_GATEWAY_ACCESS_LOG='-'\n"
        'TURNSTILE_API_BIND="127.0.0.1:9000 # not a comment inside quotes"\n'
        "TURNSTILE_ROLLOUT_CONCURRENCY=\n"
    )
    s = get_settings()
    assert (s.engine_port, s.engine_model, s.gateway_workers, s.gateway_access_log) == (8300, "tiny", 5, "-")
    assert s.api_bind == "127.0.0.1:9000 # not a comment inside quotes"
    assert s.rollout_concurrency == 8  # empty value: the default
    # The settings' parser is python-dotenv itself: the same values, key for key.
    assert dotenv_values(path) == {
        "TURNSTILE_ENGINE_PORT": "8300", "TURNSTILE_ENGINE_MODEL": "tiny", "TURNSTILE_GATEWAY_WORKERS": "5",
        "TURNSTILE_GATEWAY_ACCESS_LOG": "-", "TURNSTILE_API_BIND": "127.0.0.1:9000 # not a comment inside quotes",
        "TURNSTILE_ROLLOUT_CONCURRENCY": "",
    }


def test_process_environment_wins_over_dotenv(env, monkeypatch):
    env("TURNSTILE_ENGINE_MODEL=tiny\nREDIS_URL=redis://from-dotenv:6379/0\n")
    monkeypatch.setenv("TURNSTILE_ENGINE_MODEL", "smollm2")
    s = get_settings()
    assert s.engine_model == "smollm2"
    assert s.redis_url == "redis://from-dotenv:6379/0"


def test_an_unknown_key_in_dotenv_is_an_error(env):
    env("TURNSTILE_MODEL=tiny\n")
    with pytest.raises(SettingsError, match=r"TURNSTILE_MODEL \(in \.env\) is not a Turnstile setting"):
        get_settings()


def test_gateway_settings_come_from_app_config(env, monkeypatch):
    from app.proxy import settings as gateway

    monkeypatch.setattr(gateway, "_settings", None)
    env("TURNSTILE_GATEWAY_VISION=yes\nTURNSTILE_GATEWAY_KEEPALIVE_S=2.5\n")
    monkeypatch.setenv("TURNSTILE_GATEWAY_DEFAULT_MAX_TOKENS", "512")
    g = gateway.gateway_settings()
    assert (g.vision, g.keepalive_s, g.default_max_tokens) == (True, 2.5, 512)
    assert g.max_body_bytes == Settings.model_fields["gateway_max_body_bytes"].default
    assert gateway.gateway_settings() is g  # built once per settings object
    monkeypatch.setenv("TURNSTILE_GATEWAY_MAX_BODY_BYTES", "lots")
    config.reset_settings()
    with pytest.raises(SettingsError, match="TURNSTILE_GATEWAY_MAX_BODY_BYTES='lots'"):
        gateway.gateway_settings()


def test_gunicorn_configs_read_app_config(env, monkeypatch):
    monkeypatch.setenv("TURNSTILE_GATEWAY_BIND", "127.0.0.1:9100")
    monkeypatch.setenv("TURNSTILE_GATEWAY_THREADS", "7")
    env("TURNSTILE_API_WORKERS=3\nTURNSTILE_LOG_LEVEL=warning\n")
    gateway = runpy.run_path(str(ROOT / "workers" / "gateway_conf.py"))
    api = runpy.run_path(str(ROOT / "workers" / "api_conf.py"))
    assert (gateway["bind"], gateway["threads"], gateway["workers"], gateway["timeout"]) == ("127.0.0.1:9100", 7, 2, 0)
    assert gateway["loglevel"] == api["loglevel"] == "warning"
    assert (api["bind"], api["workers"]) == ("127.0.0.1:8000", 3)
    assert gateway["worker_class"] == "gevent"
    monkeypatch.setenv("TURNSTILE_GATEWAY_WORKER_CLASS", "gthread")
    config.reset_settings()
    assert runpy.run_path(str(ROOT / "workers" / "gateway_conf.py"))["worker_class"] == "gthread"
    monkeypatch.setenv("TURNSTILE_GATEWAY_WORKER_CLASS", "eventlet")
    config.reset_settings()
    with pytest.raises(SettingsError, match="TURNSTILE_GATEWAY_WORKER_CLASS"):
        runpy.run_path(str(ROOT / "workers" / "gateway_conf.py"))


def test_launch_fills_procfile_placeholders_from_settings(env, monkeypatch):
    from workers.launch import expand

    monkeypatch.setenv("TURNSTILE_CPU_CONCURRENCY", "2")
    argv = expand(["celery", "-c", "{cpu_concurrency}", "-n", "cpu@%h", "--port={flower_port}"], get_settings())
    assert argv == ["celery", "-c", "2", "-n", "cpu@%h", "--port=5555"]
    with pytest.raises(SettingsError, match="not a setting"):
        expand(["{cpu_workers}"], get_settings())


def test_only_app_config_parses_dotenv():
    """make, honcho and the CLI leave `.env` to app.config; the Procfile expands no shell variables."""
    import app.cli

    assert not hasattr(app.cli, "load_dotenv")
    makefile = (ROOT / "Makefile").read_text()
    assert "include .env" not in makefile and "scripts/up.sh" in makefile
    for script in ("with_stack.sh", "up.sh"):  # demo.sh and learn.sh start honcho through with_stack.sh
        assert "honcho start -e /dev/null" in (ROOT / "scripts" / script).read_text(), script
    assert "$" not in (ROOT / "Procfile").read_text()


def test_module_prints_settings_and_fails_with_exit_2(env, tmp_path):
    base = {"PATH": "/usr/bin:/bin", "TURNSTILE_VAR_DIR": str(tmp_path)}
    ok = subprocess.run([sys.executable, "-m", "app.config", "redis_url", "engine_urls"], cwd=ROOT,
                        env={**base, "TURNSTILE_ENGINE_URLS": "http://a:1,http://b:2"}, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "http://a:1,http://b:2"
    bad = subprocess.run([sys.executable, "-m", "app.config"], cwd=ROOT, env={**base, "TURNSTILE_API_WORKERS": "x"},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "TURNSTILE_API_WORKERS='x'" in bad.stderr
