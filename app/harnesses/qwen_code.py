"""Qwen Code (`@qwen-code/qwen-code` 0.24.4): OpenAI Chat Completions, streamed with `include_usage`.

Config: `$HOME/.qwen/settings.json` (auth type `openai`, model name, privacy,
telemetry and update switches off, managed auto-memory off) plus the
environment (`OPENAI_BASE_URL` = gateway + `/v1`, `OPENAI_API_KEY` = session
token, `OPENAI_MODEL`).

Traps handled: Qwen OAuth must never be selected headless (auth type pinned to
`openai`); `--yolo` is required for the shell and edit tools to exist at all;
the background "managed auto-memory" sub-agent (a second chat call per prompt)
is switched off so an episode's calls are the agent's own; an unpinned npm
install can resolve an old cached version, so the version is pinned.

Budget: `--max-session-turns` = `max_turns`; `max_tokens` goes into
`model.generationConfig.samplingParams.max_tokens`.
"""
from __future__ import annotations

from pathlib import Path

from app.harnesses.base import HarnessPreset, ScriptedTurn, check_tool_calls, gateway_base, prompt_arg, write_json
from app.runconfig import Budget

OFF = {"privacy": {"usageStatisticsEnabled": False},
       "telemetry": {"enabled": False},
       "general": {"disableAutoUpdate": True, "disableUpdateNag": True}}


class QwenCode(HarnessPreset):
    name = "qwen-code"
    package = "@qwen-code/qwen-code"
    version = "0.24.4"
    api = "chat"
    bin_name = "qwen"
    outside_hosts = ("registry.npmjs.org", "dashscope.aliyuncs.com", "chat.qwen.ai")
    # The first agent call's prompt in SmolLM2 tokens with a one-line task: 17801 measured on 2026-11-30
    # with `python -m app harness check qwen-code --json` (first_prompt_tokens) at the
    # pinned version, rounded down; re-measure when `version` changes (tests/harnesses checks it).
    min_prompt_tokens = 17800

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        write_json(Path(home) / ".qwen" / "settings.json", {
            **OFF,
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": model, "maxSessionTurns": budget.max_turns,
                      "generationConfig": {"samplingParams": {"max_tokens": budget.max_tokens}}},
            "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
        })

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        return [str(self.executable), "-p", prompt_arg(problem_statement), "--yolo", "--auth-type", "openai",
                "--max-session-turns", str(budget.max_turns)]

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        return {**self.base_env(home), "OPENAI_BASE_URL": gateway_base(gateway_url, "/v1"),
                "OPENAI_API_KEY": api_key, "OPENAI_MODEL": model, "QWEN_CODE_NO_RELAUNCH": "1"}

    def check_script(self) -> list[ScriptedTurn]:
        return [*check_tool_calls("run_shell_command", description="Run a check command"),
                ScriptedTurn(text="Done: hello.txt written.")]
