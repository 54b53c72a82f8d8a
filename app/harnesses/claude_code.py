"""Claude Code (`@anthropic-ai/claude-code` 2.1.332): Anthropic Messages API, streamed.

Config: environment (`ANTHROPIC_BASE_URL` = gateway without `/v1`,
`ANTHROPIC_API_KEY` = session token, sent as `x-api-key`) plus
`$HOME/.claude/settings.json` that repeats the offline switches and marks the
onboarding done.  Every model slot (main, haiku/small-fast, sub-agent) is the
episode's model, so no call leaves for a name the gateway does not serve.

Traps handled: without `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` it opens
TLS connections straight to api.anthropic.com (not the base URL); the
auto-updater, telemetry, error reporting and the bug command are off; shell and
edit tools only run non-interactively with `--allowedTools` (we list them) or
`--dangerously-skip-permissions`, which refuses to run as root, so
`--allowedTools` is used; `CLAUDE_CODE_ATTRIBUTION_HEADER=0` keeps the system
prompt stable across turns (better prefix merging).

Budget: `--max-turns` = `max_turns` (agentic turns); `CLAUDE_CODE_MAX_OUTPUT_TOKENS`
= `max_tokens` (settings `env`), so the request's `max_tokens` matches the budget.
"""
from __future__ import annotations

from pathlib import Path

from app.harnesses.base import HarnessPreset, ScriptedTurn, check_tool_calls, gateway_base, prompt_arg, write_json
from app.runconfig import Budget

ALLOWED_TOOLS = "Bash,Edit,Write,Read,Glob,Grep,MultiEdit,NotebookEdit,TodoWrite"

OFFLINE_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
    "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
}


class ClaudeCode(HarnessPreset):
    name = "claude-code"
    package = "@anthropic-ai/claude-code"
    version = "2.1.332"
    api = "anthropic"
    bin_name = "claude"
    outside_hosts = ("api.anthropic.com", "statsig.anthropic.com", "sentry.io", "storage.googleapis.com")
    # The first agent call's prompt in SmolLM2 tokens with a one-line task: 13522 measured on 2026-11-30
    # with `python -m app harness check claude-code --json` (first_prompt_tokens) at the
    # pinned version, rounded down; re-measure when `version` changes (tests/harnesses checks it).
    min_prompt_tokens = 13500

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        home = Path(home)
        write_json(home / ".claude" / "settings.json", {
            "env": {**OFFLINE_ENV, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(budget.max_tokens)},
            "includeCoAuthoredBy": False,
            "cleanupPeriodDays": 1,
            "autoUpdates": False,
            "permissions": {"allow": ALLOWED_TOOLS.split(","), "defaultMode": "acceptEdits"},
        })
        # Skips the first-run onboarding/theme prompt (interactive mode only, harmless in -p).
        write_json(home / ".claude.json", {"hasCompletedOnboarding": True, "autoUpdates": False,
                                           "bypassPermissionsModeAccepted": True})

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        return [str(self.executable), "-p", prompt_arg(problem_statement), "--output-format", "json",
                "--max-turns", str(budget.max_turns), "--allowedTools", ALLOWED_TOOLS]

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        return {**self.base_env(home), **OFFLINE_ENV,
                "ANTHROPIC_BASE_URL": gateway_base(gateway_url),
                "ANTHROPIC_API_KEY": api_key,
                "ANTHROPIC_MODEL": model,
                "ANTHROPIC_SMALL_FAST_MODEL": model,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
                "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
                "CLAUDE_CODE_SUBAGENT_MODEL": model}

    def check_script(self) -> list[ScriptedTurn]:
        return [*check_tool_calls("Bash", strict_edit=True, description="Run a check command", timeout=60000.0),
                ScriptedTurn(text="Done: hello.txt written.")]
