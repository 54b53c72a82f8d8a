"""Gemini CLI (`@google/gemini-cli` 0.61.0): Gemini v1beta `streamGenerateContent?alt=sse`.

Config: `$HOME/.gemini/settings.json` pins the auth type to `gemini-api-key`
and the model (which also skips the router call), and turns usage statistics,
telemetry, auto-update and the update nag off.  Environment:
`GOOGLE_GEMINI_BASE_URL` = gateway (no `/v1beta`; the genai SDK adds it),
`GEMINI_API_KEY` = session token (sent as `x-goog-api-key`),
`GEMINI_CLI_TRUST_WORKSPACE=true`.

Traps handled: with `GOOGLE_GEMINI_BASE_URL` set this
release picks auth type "gateway", which headless mode rejects (rc 41) unless
`selectedType` is pinned; an untrusted folder exits rc 55; the router call
(`gemini-3.5-flash-lite:generateContent`, JSON mode) is skipped by naming the
model, and would otherwise need schema-valid JSON; `--yolo` makes the shell
tool available, and the Docker sandbox stays off (`--sandbox=false`).

Budget: `model.maxSessionTurns` = `max_turns`; `max_tokens` has no setting in
this release (best effort: the gateway's default applies).
"""
from __future__ import annotations

from pathlib import Path

from app.harnesses.base import HarnessPreset, ScriptedTurn, check_tool_calls, gateway_base, prompt_arg, write_json
from app.runconfig import Budget


class GeminiCli(HarnessPreset):
    name = "gemini-cli"
    package = "@google/gemini-cli"
    version = "0.61.0"
    api = "gemini"
    bin_name = "gemini"
    outside_hosts = ("play.googleapis.com", "cloudcode-pa.googleapis.com", "registry.npmjs.org")
    # The first agent call's prompt in SmolLM2 tokens with a one-line task: 11785 measured on 2026-11-30
    # with `python -m app harness check gemini-cli --json` (first_prompt_tokens) at the
    # pinned version, rounded down; re-measure when `version` changes (tests/harnesses checks it).
    min_prompt_tokens = 11750

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        write_json(Path(home) / ".gemini" / "settings.json", {
            "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True, "enableAutoUpdate": False,
                        "enableAutoUpdateNotification": False},
            "model": {"name": model, "maxSessionTurns": budget.max_turns},
            "tools": {"sandbox": False},
            "ide": {"enabled": False},
        })

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        return [str(self.executable), "-p", prompt_arg(problem_statement), "--yolo", "--sandbox=false"]

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        return {**self.base_env(home), "GOOGLE_GEMINI_BASE_URL": gateway_base(gateway_url),
                "GEMINI_API_KEY": api_key, "GEMINI_MODEL": model, "GEMINI_CLI_TRUST_WORKSPACE": "true",
                "GEMINI_TELEMETRY_ENABLED": "false", "GEMINI_SANDBOX": "false"}

    def check_script(self) -> list[ScriptedTurn]:
        return [*check_tool_calls("run_shell_command", description="Run a check command"),
                ScriptedTurn(text="Done: hello.txt written.")]
