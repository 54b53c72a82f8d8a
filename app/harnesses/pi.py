"""Pi coding agent (`@mariozechner/pi-coding-agent` 0.73.1): OpenAI Chat Completions (`openai-completions`).

Config: `$HOME/.pi/agent/models.json` declares a provider `turnstile`
(`baseUrl` = gateway + `/v1`, `api: "openai-completions"`, `apiKey` names the
environment variable holding the session token) and `settings.json` makes it
the default provider/model with install telemetry off.  Pi can also speak
`openai-responses`, `anthropic-messages` and `google-generative-ai` by changing
`api` (and the base URL suffix).

Traps handled: `PI_OFFLINE=1` (also skips the npm version check),
`PI_TELEMETRY=0` (the install ping to pi.dev), `--no-session` (no session files),
`--no-extensions`/`--no-skills` (no discovery from the workspace).

Budget: `max_tokens` = the model's `maxTokens` in models.json; Pi has no turn
limit (best effort: the agent time budget bounds it).
"""
from __future__ import annotations

from pathlib import Path

from app.harnesses.base import HarnessPreset, ScriptedTurn, check_tool_calls, gateway_base, prompt_arg, write_json
from app.runconfig import Budget

KEY_ENV = "TURNSTILE_API_KEY"
PROVIDER = "turnstile"


class Pi(HarnessPreset):
    name = "pi"
    package = "@mariozechner/pi-coding-agent"
    version = "0.73.1"
    api = "chat"
    bin_name = "pi"
    outside_hosts = ("registry.npmjs.org", "pi.dev")
    # The first agent call's prompt in SmolLM2 tokens with a one-line task: 1528 measured on 2026-11-30
    # with `python -m app harness check pi --json` (first_prompt_tokens) at the
    # pinned version, rounded down; re-measure when `version` changes (tests/harnesses checks it).
    min_prompt_tokens = 1500

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        agent = Path(home) / ".pi" / "agent"
        write_json(agent / "models.json", {"providers": {PROVIDER: {
            "baseUrl": gateway_base(gateway_url, "/v1"), "api": "openai-completions", "apiKey": KEY_ENV,
            "models": [{"id": model, "name": model, "contextWindow": 131072, "maxTokens": budget.max_tokens}],
        }}})
        write_json(agent / "settings.json", {"defaultProvider": PROVIDER, "defaultModel": model,
                                             "enableInstallTelemetry": False, "quietStartup": True})

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        return [str(self.executable), "--provider", PROVIDER, "--no-session", "--no-extensions", "--no-skills",
                "--no-prompt-templates", "--no-themes", "--offline", "-p", prompt_arg(problem_statement)]

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        return {**self.base_env(home), KEY_ENV: api_key, "PI_OFFLINE": "1", "PI_TELEMETRY": "0",
                "PI_SKIP_VERSION_CHECK": "1"}

    def check_script(self) -> list[ScriptedTurn]:
        return [*check_tool_calls("bash", timeout=60.0),
                ScriptedTurn(text="Done: hello.txt written.")]
