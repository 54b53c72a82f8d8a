"""Preset unit tests: registry, config files (gateway URL + key where each CLI reads them, telemetry
and update checks off), commands, environment, and the conformance scripted engine's reply choice.

No CLI runs here (see test_harness_cli_runs.py for the real runs).
"""
from __future__ import annotations

import json
import stat
import tomllib
from pathlib import Path

from app.config import ROOT

import pytest
import yaml

from app.conformance.scripted.check import choose_reply
from app.harnesses import PRESETS, get_preset
from app.harnesses.base import APIS, HarnessInstallError, prompt_arg
from app.runconfig import HARNESSES, Budget

GW = "http://127.0.0.1:18100"
KEY = "tsk-unit-test-session-token"
MODEL = "smollm2"
BUDGET = Budget(max_turns=5, max_tokens=321)


def configure(name: str, home: Path) -> tuple[dict, list[str]]:
    preset = get_preset(name)
    preset.write_config(home, GW, KEY, MODEL, BUDGET)
    return preset.env(home, GW, KEY, MODEL), preset.command("Fix the bug in foo.py", BUDGET)


def all_files(home: Path) -> dict[str, str]:
    return {str(p.relative_to(home)): p.read_text() for p in home.rglob("*") if p.is_file()}


def test_registry_names_match_runconfig_and_unknown_names_fail():
    assert tuple(PRESETS) == HARNESSES
    for name, preset in PRESETS.items():
        assert preset.name == name and preset.api in APIS and preset.version[0].isdigit()
    with pytest.raises(ValueError) as err:
        get_preset("cursor")
    for name in HARNESSES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", HARNESSES)
def test_key_never_on_the_command_line_and_files_private(name, tmp_path):
    if name == "mini-swe-agent" and not get_preset(name).is_installed():
        pytest.skip("mini-swe-agent's config is built from its installed mini.yaml; run `python -m app harness install mini-swe-agent`")
    env, argv = configure(name, tmp_path)
    assert KEY not in " ".join(argv)
    assert argv[0] == str(get_preset(name).executable)
    assert "Fix the bug in foo.py" in argv
    assert env["HOME"] == str(tmp_path) and "PATH" not in env
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_prompt_that_looks_like_an_option_is_kept_as_one_argument():
    assert prompt_arg("--help me") == " --help me"
    assert prompt_arg("@file") == " @file"
    assert prompt_arg("fix it") == "fix it"
    argv = get_preset("pi").command("-rf everything", BUDGET)
    assert argv[-1] == " -rf everything"


def test_codex_config(tmp_path):
    env, argv = configure("codex", tmp_path)
    cfg = tomllib.loads((tmp_path / ".codex" / "config.toml").read_text())
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert provider["base_url"] == GW + "/v1" and provider["wire_api"] == "responses"
    assert env[provider["env_key"]] == KEY and env["CODEX_HOME"] == str(tmp_path / ".codex")
    assert cfg["model"] == MODEL
    assert cfg["check_for_update_on_startup"] is False and cfg["analytics"]["enabled"] is False
    assert not any(cfg["features"][k] for k in ("plugins", "remote_plugin", "apps", "api_key_model_discovery"))
    assert provider["supports_websockets"] is False
    assert "exec" in argv and "--skip-git-repo-check" in argv
    assert KEY not in all_files(tmp_path)[".codex/config.toml"]


def test_claude_code_config(tmp_path):
    env, argv = configure("claude-code", tmp_path)
    assert env["ANTHROPIC_BASE_URL"] == GW and env["ANTHROPIC_API_KEY"] == KEY
    assert env["ANTHROPIC_MODEL"] == MODEL and env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == MODEL
    settings = json.loads((tmp_path / ".claude" / "settings.json").read_text())
    for source in (env, settings["env"]):
        assert source["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
        assert source["DISABLE_TELEMETRY"] == "1" and source["DISABLE_AUTOUPDATER"] == "1"
    assert settings["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(BUDGET.max_tokens)
    assert argv[argv.index("--max-turns") + 1] == str(BUDGET.max_turns)
    assert "Bash" in argv[argv.index("--allowedTools") + 1].split(",")


def test_qwen_code_config(tmp_path):
    env, argv = configure("qwen-code", tmp_path)
    assert env["OPENAI_BASE_URL"] == GW + "/v1" and env["OPENAI_API_KEY"] == KEY and env["OPENAI_MODEL"] == MODEL
    s = json.loads((tmp_path / ".qwen" / "settings.json").read_text())
    assert s["telemetry"]["enabled"] is False and s["privacy"]["usageStatisticsEnabled"] is False
    assert s["general"]["disableAutoUpdate"] is True and s["security"]["auth"]["selectedType"] == "openai"
    assert s["memory"]["enableManagedAutoMemory"] is False
    assert argv[argv.index("--max-session-turns") + 1] == str(BUDGET.max_turns) and "--yolo" in argv


def test_gemini_cli_config(tmp_path):
    env, argv = configure("gemini-cli", tmp_path)
    assert env["GOOGLE_GEMINI_BASE_URL"] == GW and env["GEMINI_API_KEY"] == KEY
    assert env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    s = json.loads((tmp_path / ".gemini" / "settings.json").read_text())
    assert s["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert s["telemetry"]["enabled"] is False and s["privacy"]["usageStatisticsEnabled"] is False
    assert s["general"]["disableAutoUpdate"] is True and s["general"]["enableAutoUpdate"] is False
    assert s["model"]["name"] == MODEL and s["model"]["maxSessionTurns"] == BUDGET.max_turns


def test_opencode_config(tmp_path):
    env, argv = configure("opencode", tmp_path)
    cfg = json.loads((tmp_path / ".config" / "opencode" / "opencode.json").read_text())
    provider_id, model_id = cfg["model"].split("/", 1)
    provider = cfg["provider"][provider_id]
    assert provider["options"]["baseURL"] == GW + "/v1" and provider["npm"] == "@ai-sdk/openai-compatible"
    env_name = provider["options"]["apiKey"].removeprefix("{env:").removesuffix("}")
    assert env[env_name] == KEY and model_id == MODEL
    assert provider["models"][MODEL]["limit"]["output"] == BUDGET.max_tokens
    assert cfg["autoupdate"] is False and cfg["share"] == "disabled"
    for flag in ("OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_DEFAULT_PLUGINS"):
        assert env[flag] == "1"
    assert env["XDG_CONFIG_HOME"] == str(tmp_path / ".config")
    assert argv[1] == "run"


def test_pi_config(tmp_path):
    env, argv = configure("pi", tmp_path)
    models = json.loads((tmp_path / ".pi" / "agent" / "models.json").read_text())
    settings = json.loads((tmp_path / ".pi" / "agent" / "settings.json").read_text())
    provider = models["providers"][settings["defaultProvider"]]
    assert provider["baseUrl"] == GW + "/v1" and provider["api"] == "openai-completions"
    assert env[provider["apiKey"]] == KEY and settings["defaultModel"] == MODEL
    assert provider["models"][0]["maxTokens"] == BUDGET.max_tokens
    assert settings["enableInstallTelemetry"] is False
    assert env["PI_OFFLINE"] == "1" and env["PI_TELEMETRY"] == "0"
    assert "--no-session" in argv and argv[argv.index("--provider") + 1] == settings["defaultProvider"]


def test_mini_swe_agent_config(tmp_path):
    preset = get_preset("mini-swe-agent")
    if not preset.is_installed():
        pytest.skip("mini-swe-agent not installed: run `python -m app harness install mini-swe-agent`")
    env, argv = configure("mini-swe-agent", tmp_path)
    cfg = yaml.safe_load(Path(env["MSWEA_MINI_CONFIG_PATH"]).read_text())
    assert cfg["model"]["model_kwargs"]["api_base"] == GW + "/v1"
    assert cfg["model"]["model_kwargs"]["max_tokens"] == BUDGET.max_tokens
    assert cfg["model"]["model_name"] == "openai/" + MODEL
    assert cfg["agent"]["step_limit"] == BUDGET.max_turns
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in cfg["agent"]["instance_template"]  # built-in template kept
    assert env["OPENAI_API_KEY"] == KEY and env["MSWEA_CONFIGURED"] == "true"
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert "-c" not in argv  # the config comes from MSWEA_MINI_CONFIG_PATH, never from the workspace


def test_install_failure_is_a_clear_error(tmp_path):
    preset = type("Broken", (type(get_preset("pi")),), {"version": "0.0.0-does-not-exist"})(tools=tmp_path)
    assert not preset.is_installed()
    with pytest.raises(HarnessInstallError) as err:
        preset.install()
    assert "@mariozechner/pi-coding-agent@0.0.0-does-not-exist" in str(err.value)
    with pytest.raises(HarnessInstallError, match="python -m app harness install pi"):
        preset.require_installed()


def test_install_is_idempotent_when_present():
    preset = get_preset("pi")
    if not preset.is_installed():
        pytest.skip("pi not installed")
    assert preset.install() == 0.0


def test_scripted_engine_reply_choice():
    turns = get_preset("codex").check_script()
    tools = [{"type": "function", "function": {"name": "exec_command"}}]
    first = choose_reply(turns, {"messages": [{"role": "user", "content": "go"}], "tools": tools})
    assert first["tool_calls"][0]["name"] == "exec_command"
    calls = sum(1 for t in turns if t.tool)
    assert calls >= 5  # the check measures merge fidelity over a multi-turn session
    made = [m for k in range(calls) for m in (
        {"role": "assistant", "tool_calls": [{"id": f"c{k}", "function": {"name": "exec_command"}}]},
        {"role": "tool", "content": "ok"})]
    second = {"messages": [{"role": "user", "content": "go"}, *made[:2]], "tools": tools}
    assert choose_reply(turns, second)["tool_calls"][0]["arguments"] == turns[1].arguments
    after = {"messages": [{"role": "user", "content": "go"}, *made], "tools": tools}
    assert "tool_calls" not in choose_reply(turns, after) and choose_reply(turns, after)["text"]
    # auxiliary calls (no edit tool, or JSON mode) get the scripted engine's default
    assert choose_reply(turns, {"messages": [{"role": "user", "content": "title?"}]}) == {}
    assert choose_reply(turns, {"messages": [], "tools": tools, "response_format": {"type": "json_object"}}) == {}


APP = ROOT / "app"


def _app_imports(path: Path) -> set[str]:
    """Every `app.*` module `path` imports (top level or inside functions)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == "app" or a.name.startswith("app.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and (node.module == "app" or node.module.startswith("app.")):
            found.add(node.module)
    return found


def test_presets_import_only_the_bottom_layer():
    allowed = ("app.harnesses", "app.runconfig", "app.config")
    for path in sorted((APP / "harnesses").glob("*.py")):
        bad = {m for m in _app_imports(path) if not any(m == a or m.startswith(a + ".") for a in allowed)}
        assert not bad, f"{path.name} imports {sorted(bad)}"


def test_only_the_harness_cli_imports_the_conformance_checks():
    importers = sorted(str(p.relative_to(APP)) for p in APP.rglob("*.py")
                       if "conformance" not in p.relative_to(APP).parts
                       and any(m == "app.conformance" or m.startswith("app.conformance.") for m in _app_imports(p)))
    assert importers == ["cli/harness.py"]
