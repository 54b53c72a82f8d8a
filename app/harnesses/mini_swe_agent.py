"""mini-swe-agent (PyPI `mini-swe-agent` 2.4.6, LiteLLM): OpenAI Chat Completions, non-streaming, one `bash` tool.

Installed into its own venv `<tools>/mini-swe-agent/venv` (LiteLLM and friends
never touch Turnstile's or the task's environment); started by absolute path so
the agent's shell keeps the task venv's `python` first on PATH.

Config: `$HOME/.config/mini-swe-agent/turnstile.yaml` (the built-in `mini.yaml`
with our keys merged in, named by `MSWEA_MINI_CONFIG_PATH`) sets `model.model_name = openai/<model>`, `api_base` = gateway +
`/v1`, `max_tokens`, cost tracking off; the key comes from `OPENAI_API_KEY`.
The trajectory goes to `$HOME/.config/mini-swe-agent/last_mini_run.traj.json`.

Traps handled: `MSWEA_CONFIGURED=true` (else the first-run
wizard aborts with rc 1 on a non-TTY stdin); `MSWEA_COST_TRACKING=ignore_errors`
(the model is not in LiteLLM's price table); `LITELLM_LOCAL_MODEL_COST_MAP=True`
(else LiteLLM fetches its price map from raw.githubusercontent.com at import);
`-y --exit-immediately` (no confirmations).  The agent finishes only when the
model runs `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` (exit status
`Submitted`); otherwise it stops at the step limit with a non-zero exit.

Budget: `agent.step_limit` = `max_turns`; `model.model_kwargs.max_tokens` = `max_tokens`.
"""
from __future__ import annotations

import platform
from pathlib import Path

import yaml

from app.harnesses.base import HarnessPreset, ScriptedTurn, check_tool_calls, gateway_base, prompt_arg, write_text
from app.runconfig import Budget

CONFIG_DIR = Path(".config") / "mini-swe-agent"
CONFIG_NAME = "turnstile.yaml"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# The one tool mini-swe-agent 2.4.6 declares in tool-call mode (minisweagent/models/utils/actions_toolcall.py).
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "required": ["command"],
                   "properties": {"command": {"type": "string", "description": "The bash command to execute"}}}}}


class MiniSweAgent(HarnessPreset):
    name = "mini-swe-agent"
    package = "mini-swe-agent"
    version = "2.4.6"
    api = "chat"
    bin_name = "mini"
    ecosystem = "pip"
    outside_hosts = ("raw.githubusercontent.com",)
    # The first agent call's prompt in SmolLM2 tokens with a one-line task: 1024 measured on 2026-11-30
    # with `python -m app harness check mini-swe-agent --json` (first_prompt_tokens) at the
    # pinned version, rounded down; re-measure when `version` changes (tests/harnesses checks it).
    min_prompt_tokens = 1000
    submit_command = SUBMIT

    def builtin_config(self) -> Path:
        """Absolute path of the package's own `mini.yaml` (never a same-named file in the workspace)."""
        found = sorted((self.root / "venv" / "lib").glob("python3*/site-packages/minisweagent/config/mini.yaml"))
        if not found:
            self.require_installed()
            raise FileNotFoundError(f"mini.yaml not found under {self.root / 'venv'}")
        return found[0]

    def builtin_settings(self) -> dict:
        """The package's own `mini.yaml`, parsed (an empty file reads as `{}`)."""
        return yaml.safe_load(self.builtin_config().read_text(encoding="utf-8")) or {}

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        # One complete config (the built-in mini.yaml with our overrides merged in), found through
        # MSWEA_MINI_CONFIG_PATH: no `-c` on the command line, so no relative config name can be
        # resolved against the agent-controlled workspace.
        config = self.builtin_settings()
        model_cfg = config.setdefault("model", {})
        model_cfg.update(model_name="openai/" + model, cost_tracking="ignore_errors")
        model_cfg.setdefault("model_kwargs", {}).update(api_base=gateway_base(gateway_url, "/v1"),
                                                        max_tokens=int(budget.max_tokens), drop_params=True)
        agent_cfg = config.setdefault("agent", {})
        agent_cfg.update(step_limit=int(budget.max_turns), cost_limit=0)
        config.setdefault("environment", {}).setdefault("environment_class", "local")
        text = "# Written by Turnstile for one episode: built-in mini.yaml + gateway settings.\n"
        write_text(Path(home) / CONFIG_DIR / CONFIG_NAME, text + yaml.safe_dump(config, sort_keys=False))

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        return [str(self.executable), "-t", prompt_arg(problem_statement), "-y", "--exit-immediately"]

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        config_dir = Path(home) / CONFIG_DIR
        return {**self.base_env(home), "OPENAI_API_KEY": api_key,
                "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_GLOBAL_CONFIG_DIR": str(config_dir), "MSWEA_MINI_CONFIG_PATH": str(config_dir / CONFIG_NAME),
                "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "PYTHONUNBUFFERED": "1"}

    def first_messages(self, problem_statement: str) -> tuple[list[dict], list[dict]]:
        """The Chat Completions `(messages, tools)` of the agent's first call for `problem_statement`.

        Rendered like the agent does (`DefaultAgent`): its installed `mini.yaml` system and instance
        templates (jinja2) with the task and `platform.uname()` fields, and the `bash` tool.  Used to
        build warm-start demonstrations on exactly the prompt the agent sends.
        Raises FileNotFoundError when the harness is not installed.
        """
        import jinja2

        agent = self.builtin_settings()["agent"]
        values = {**platform.uname()._asdict(), "task": problem_statement}
        render = lambda name: jinja2.Template(agent[name], undefined=jinja2.StrictUndefined).render(**values)  # noqa: E731
        return [{"role": "system", "content": render("system_template")},
                {"role": "user", "content": render("instance_template")}], [BASH_TOOL]

    def observation(self, returncode: int, output: str) -> str:
        """The tool-result text the agent sends after a command (its `model.observation_template`)."""
        import jinja2

        template = self.builtin_settings()["model"]["observation_template"]
        return jinja2.Template(template).render(output={"returncode": returncode, "output": output, "exception_info": ""})

    def check_script(self) -> list[ScriptedTurn]:
        return [*check_tool_calls("bash"),
                ScriptedTurn(text="Submitting.", tool="bash", arguments={"command": SUBMIT})]
