"""OpenCode (`opencode-ai` 1.18.33): OpenAI Chat Completions via `@ai-sdk/openai-compatible`, streamed.

Config: `$HOME/.config/opencode/opencode.json` declares a provider `turnstile`
(`baseURL` = gateway + `/v1`, `apiKey` = `{env:TURNSTILE_API_KEY}` so the key
stays in the environment) with the episode's model as both `model` and
`small_model`, `autoupdate: false`, `share: "disabled"`.

Traps handled: the model catalogue fetch (models.dev /
models.opencode.ai), auto-update, LSP downloads, sharing and default plugins
are switched off by environment; it still attempts a background npm install of
`@opencode-ai/plugin` into `$HOME/.config/opencode` (non-blocking, only logged;
no network in the sandbox makes it fail fast).  Model ids that look like
`gpt-5*` would make the AI SDK switch to Responses; the model id is the
episode's model name as given.  `opencode run` wraps a prompt containing
spaces in literal double quotes (the harness's own behaviour, kept).

Budget: `max_tokens` = the model's `limit.output`; `max_turns` = the build
agent's `steps` limit.
"""
from __future__ import annotations

from pathlib import Path

from app.harnesses.base import HarnessPreset, ScriptedTurn, check_tool_calls, gateway_base, prompt_arg, write_json
from app.runconfig import Budget

KEY_ENV = "TURNSTILE_API_KEY"
OFFLINE_ENV = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",
}


class OpenCode(HarnessPreset):
    name = "opencode"
    package = "opencode-ai"
    version = "1.18.33"
    api = "chat"
    bin_name = "opencode"
    outside_hosts = ("models.dev", "models.opencode.ai", "registry.npmjs.org", "api.github.com")
    # The first agent call's prompt in SmolLM2 tokens with a one-line task: 7767 measured on 2026-11-30
    # with `python -m app harness check opencode --json` (first_prompt_tokens) at the
    # pinned version, rounded down; re-measure when `version` changes (tests/harnesses checks it).
    min_prompt_tokens = 7750

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        write_json(Path(home) / ".config" / "opencode" / "opencode.json", {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"turnstile": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Turnstile gateway",
                "options": {"baseURL": gateway_base(gateway_url, "/v1"), "apiKey": "{env:%s}" % KEY_ENV},
                "models": {model: {"name": model, "tool_call": True,
                                   "limit": {"context": 131072, "output": budget.max_tokens}}},
            }},
            "model": f"turnstile/{model}",
            "small_model": f"turnstile/{model}",
            "autoupdate": False,
            "share": "disabled",
            "agent": {"build": {"steps": budget.max_turns}},
        })

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        return [str(self.executable), "run", prompt_arg(problem_statement)]

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        return {**self.base_env(home), **OFFLINE_ENV, KEY_ENV: api_key}

    def check_script(self) -> list[ScriptedTurn]:
        return [*check_tool_calls("bash", description="Run a check command", timeout=60000.0),
                ScriptedTurn(text="Done: hello.txt written.")]
