"""Codex CLI (`@openai/codex` 0.171.0): OpenAI Responses API over SSE, the only API it speaks.

Config: `$HOME/.codex/config.toml` (CODEX_HOME points there) defines a custom
provider `turnstile` with `base_url = <gateway>/v1`, `wire_api = "responses"` and
`env_key = TURNSTILE_API_KEY` (the key itself stays in the environment).
A custom provider is used instead of the built-in `openai` one because the
built-in provider first tries 7 Responses-over-WebSocket upgrades (~6 s) and
ignores `OPENAI_BASE_URL`.

Traps handled: `codex exec` reads stdin and hangs on an open pipe (the runner
must give it /dev/null or an empty, closed stdin); update checks, analytics,
plugins, apps and model discovery are off (they reach github.com,
api.github.com, chatgpt.com); Codex's own seccomp/landlock sandbox is bypassed
because Turnstile's runtime is the sandbox.

Budget: best effort.  Codex 0.171.0 has neither a turn limit nor a per-call
output-token setting for custom providers; `max_turns`/`max_tokens` are enforced
by the agent time budget and the gateway's `max_tokens` default.
"""
from __future__ import annotations

import json
from pathlib import Path

from app.harnesses.base import HarnessPreset, ScriptedTurn, check_tool_calls, gateway_base, prompt_arg, write_text
from app.runconfig import Budget

KEY_ENV = "TURNSTILE_API_KEY"


def _toml_str(value: str) -> str:
    # A JSON string literal is a valid TOML basic string (same escapes).
    return json.dumps(value)


class Codex(HarnessPreset):
    name = "codex"
    package = "@openai/codex"
    version = "0.171.0"
    api = "responses"
    bin_name = "codex"
    outside_hosts = ("github.com", "api.github.com", "chatgpt.com", "api.openai.com")
    # The first agent call's prompt in SmolLM2 tokens with a one-line task: 9185 measured on 2026-11-30
    # with `python -m app harness check codex --json` (first_prompt_tokens) at the
    # pinned version, rounded down; re-measure when `version` changes (tests/harnesses checks it).
    min_prompt_tokens = 9150

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        config = f"""# Written by Turnstile for one episode.
model = {_toml_str(model)}
model_provider = "turnstile"
check_for_update_on_startup = false
web_search = "disabled"

[model_providers.turnstile]
name = "Turnstile gateway"
base_url = {_toml_str(gateway_base(gateway_url, "/v1"))}
env_key = "{KEY_ENV}"
wire_api = "responses"
supports_websockets = false
request_max_retries = 1
stream_max_retries = 1

[analytics]
enabled = false

[history]
persistence = "none"

[features]
plugins = false
remote_plugin = false
apps = false
api_key_model_discovery = false
"""
        write_text(Path(home) / ".codex" / "config.toml", config)

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        return [str(self.executable), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                "--color", "never", prompt_arg(problem_statement)]

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        home = Path(home)
        return {**self.base_env(home), "CODEX_HOME": str(home / ".codex"), KEY_ENV: api_key,
                "RUST_LOG": "error"}

    def check_script(self) -> list[ScriptedTurn]:
        return [*check_tool_calls("exec_command", "cmd"),
                ScriptedTurn(text="Done: hello.txt written.")]
