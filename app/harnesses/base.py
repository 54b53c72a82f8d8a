"""`HarnessPreset`: how Turnstile installs, configures and starts one unmodified coding-agent CLI.

A preset is a stateless description.  For one episode the pipeline does:

    preset = get_preset("codex")
    preset.install()                                   # once per machine; idempotent
    preset.write_config(host_home, gateway_url, token, model, budget)
    argv = preset.command(problem_statement, budget)   # run with stdin = /dev/null, cwd = workspace
    env = preset.env(home_as_seen_by_command, gateway_url, token, model)
    # PATH: preset.path_prepend() + the runtime's PATH (the task's venv must stay on PATH)
    patch = runtime.patch()                            # `git diff` against the base, not the preset's job

`write_config` gets the *host* path of the scratch HOME (where files are written);
`env` gets HOME as the command sees it (`/home/agent` inside bubblewrap).  Config
files therefore never contain absolute HOME paths.  Every preset keeps its
secrets (the session token) out of argv: the token travels in an environment
variable or in a file under HOME, never on the command line (where `ps` and
logs would show it).

The tools live in `<var_dir>/tools/` (`TURNSTILE_TOOLS_DIR` overrides): npm CLIs
in `npm/<name>/` (an npm prefix each, so versions never clash) and
mini-swe-agent in `mini-swe-agent/venv/`.  A sandboxed run must see that folder
read-only at the same path (`LocalRuntime.prepare(ro_binds=[(tools, tools)])`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from app.config import get_settings
from app.runconfig import Budget

APIS = ("chat", "responses", "anthropic", "gemini")

# Environment every harness gets: no colours or spinners, no interactive pagers.
COMMON_ENV = {
    "NO_COLOR": "1",
    "FORCE_COLOR": "0",
    "CI": "1",
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "NO_UPDATE_NOTIFIER": "1",           # npm's update-notifier package (used by several CLIs)
    "NPM_CONFIG_UPDATE_NOTIFIER": "false",
}


# Where an npm CLI's `node` is mounted inside a task's image (its scripts start with `#!/usr/bin/env node`).
IMAGE_NODE_BIN = "/opt/turnstile/node/bin"


class HarnessInstallError(RuntimeError):
    """Installing a harness failed; the message names the package, the command and its output tail."""


def shared_tools_dir() -> Path:
    """Shared tools folder: the `TURNSTILE_TOOLS_DIR` setting, else `<var_dir>/tools`."""
    settings = get_settings()
    return settings.tools_dir or settings.var_dir / "tools"


def write_json(path: Path, data: Any) -> None:
    """Write `data` as JSON (parents created, mode 0600: these files may hold the session token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.chmod(0o600)


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)


def _tail(text: str, n: int = 2000) -> str:
    return text[-n:].strip()


@dataclass(frozen=True)
class ScriptedTurn:
    """One scripted model reply for `harness check` (engine-neutral).

    Either a tool call (`tool` = the harness's own tool name, `arguments` its JSON
    arguments) or plain `text`.  Turned into the scripted engine's format by
    `app.conformance.scripted.check`.
    """

    text: str | None = None
    tool: str | None = None
    arguments: dict | None = None


@dataclass(frozen=True)
class HarnessPreset:
    """Base class of the seven presets (subclasses set the class attributes and the three hooks).

    Class attributes: `name` (registry name), `package` (npm or PyPI name),
    `version` (pinned; the version whose behaviour the preset was verified against),
    `api` (the client API it speaks by default: chat | responses | anthropic | gemini),
    `bin_name` (executable inside the install), `min_prompt_tokens` (the smallest prompt the
    CLI sends, in SmolLM2 tokens, measured by `harness check`; None = not measured).
    """

    name: ClassVar[str]
    package: ClassVar[str]
    version: ClassVar[str]
    api: ClassVar[str]
    bin_name: ClassVar[str]
    ecosystem: ClassVar[str] = "npm"   # npm | pip
    # Hosts the CLI is known to contact when its switches are *not* set (documentation for the pipeline).
    outside_hosts: ClassVar[tuple[str, ...]] = ()
    # Tokens of the first agent call (system prompt, tool schemas, environment context) with a
    # one-line task, in the embedded models' tokenizer (SmolLM2's).  A model whose context is not
    # larger cannot serve this harness (the run is refused at creation).
    min_prompt_tokens: ClassVar[int | None] = None

    tools: Path | None = field(default=None, compare=False)

    # --- installation ---------------------------------------------------------------

    @property
    def root(self) -> Path:
        """This harness's install folder under the tools directory."""
        base = self.tools or shared_tools_dir()
        return base / "npm" / self.name if self.ecosystem == "npm" else base / self.name

    def tools_dir(self) -> Path:
        """The folder a sandbox must mount read-only at the same path for this CLI to run (= `root`)."""
        return self.root

    @property
    def executable(self) -> Path:
        """Absolute path of the CLI entry point."""
        if self.ecosystem == "npm":
            return self.root / "node_modules" / ".bin" / self.bin_name
        return self.root / "venv" / "bin" / self.bin_name

    def installed_version(self) -> str | None:
        """The version found in the install folder, or None when absent."""
        if self.ecosystem == "npm":
            manifest = self.root / "node_modules" / Path(*self.package.split("/")) / "package.json"
            try:
                return json.loads(manifest.read_text()).get("version")
            except (OSError, ValueError):
                return None
        py = self.root / "venv" / "bin" / "python"
        if not py.exists():
            return None
        proc = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({self.package!r}))"],
                              capture_output=True, text=True)
        return proc.stdout.strip() or None if proc.returncode == 0 else None

    def is_installed(self) -> bool:
        """True when the pinned version is installed and its executable exists."""
        return self.executable.exists() and self.installed_version() == self.version

    def install(self, log=None) -> float:
        """Install the pinned version into the tools folder unless it is already there.

        Returns the seconds spent (0.0 when already installed).  Raises
        `HarnessInstallError` (with the command and the output tail) when the
        installer is missing or fails.  `log` (callable taking a str) receives progress lines.
        """
        if self.is_installed():
            return 0.0
        say = log or (lambda _msg: None)
        t0 = time.monotonic()
        if self.ecosystem == "npm":
            npm = shutil.which("npm")
            if npm is None or shutil.which("node") is None:
                raise HarnessInstallError(f"{self.name}: node and npm are required (Debian packages nodejs, npm)")
            self.root.mkdir(parents=True, exist_ok=True)
            argv = [npm, "install", "--prefix", str(self.root), "--no-audit", "--no-fund", "--loglevel=error",
                    f"{self.package}@{self.version}"]
            self._run_installer(argv, say)
        else:
            venv = self.root / "venv"
            if not (venv / "bin" / "python").exists():
                self._run_installer([sys.executable, "-m", "venv", str(venv)], say)
            self._run_installer([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                                 "-q", f"{self.package}=={self.version}"], say)
        if not self.is_installed():
            raise HarnessInstallError(f"{self.name}: installed {self.package} but found version "
                                      f"{self.installed_version()!r} (want {self.version}) or no {self.executable}")
        return time.monotonic() - t0

    def _run_installer(self, argv: list[str], say) -> None:
        say(f"{self.name}: {' '.join(argv)}")
        env = {**os.environ, **COMMON_ENV}
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
        except OSError as exc:
            raise HarnessInstallError(f"{self.name}: cannot run {argv[0]}: {exc}") from exc
        if proc.returncode != 0:
            raise HarnessInstallError(f"{self.name}: `{' '.join(argv)}` exited {proc.returncode}:\n"
                                      f"{_tail(proc.stdout + proc.stderr)}")

    def require_installed(self) -> None:
        """Raise `HarnessInstallError` with the install command when the CLI is missing."""
        if not self.is_installed():
            raise HarnessInstallError(
                f"harness {self.name!r} ({self.package}@{self.version}) is not installed in {self.root}; "
                f"run `python -m app harness install {self.name}`")

    def path_prepend(self) -> list[str]:
        """Folders to put in front of the runtime's PATH (node's folder for the npm CLIs).

        The CLI itself is started by absolute path, so its install folder is not on
        PATH: the agent's shell keeps the task's venv `python` first.
        """
        if self.ecosystem != "npm":
            return []
        node = shutil.which("node")
        return [str(Path(node).parent)] if node else []

    # --- inside a task's container image (app.runtimes.oci) -------------------------------

    def image_binds(self) -> list[tuple[str, str]]:
        """(host path, path inside) read-only mounts that let this CLI run inside any glibc image
        with nothing installed there: the install folder at its own path (its scripts name it
        absolutely), plus the interpreter: the Python prefix the venv was made from (at its own
        path, which must be outside /usr) or the `node` binary at `IMAGE_NODE_BIN`.
        Raises `HarnessInstallError` when the interpreter cannot be mounted."""
        binds = [(str(self.root), str(self.root))]
        real = self.root.resolve()
        if real != self.root:
            binds.append((str(real), str(real)))  # the venv's own links name the resolved path
        if self.ecosystem == "npm":
            node = shutil.which("node")
            if node is None:
                raise HarnessInstallError(f"{self.name}: node is required (Debian packages nodejs, npm)")
            binds.append((str(Path(node).resolve()), f"{IMAGE_NODE_BIN}/node"))
        else:
            prefix = self._venv_base_prefix()
            if str(prefix).startswith("/usr"):
                raise HarnessInstallError(
                    f"{self.name}: its venv is built on {prefix}, under /usr, which an image replaces; "
                    "reinstall it with a Python outside /usr (pyenv or a standalone build) to run it in images")
            binds.append((str(prefix), str(prefix)))
        return binds

    def image_programs(self) -> list[Path]:
        """Host executables of `image_binds` that must run on the image's C library."""
        if self.ecosystem == "npm":
            node = shutil.which("node")
            return [Path(node).resolve()] if node else []
        return [(self.root / "venv" / "bin" / "python").resolve()]

    def image_path_prepend(self) -> list[str]:
        """PATH entries inside an image (what `path_prepend` is on the host)."""
        return [IMAGE_NODE_BIN] if self.ecosystem == "npm" else []

    def _venv_base_prefix(self) -> Path:
        cfg = self.root / "venv" / "pyvenv.cfg"
        try:
            home = next(line.split("=", 1)[1].strip() for line in cfg.read_text().splitlines()
                        if line.split("=", 1)[0].strip() == "home")
        except (OSError, StopIteration):
            self.require_installed()
            raise HarnessInstallError(f"{self.name}: {cfg} names no base Python (`home`)") from None
        return Path(home).resolve().parent

    # --- per-episode hooks (subclasses) ------------------------------------------------

    def write_config(self, home: Path, gateway_url: str, api_key: str, model: str, budget: Budget) -> None:
        """Write the CLI's config files under `home` (host path of the scratch HOME)."""
        raise NotImplementedError

    def command(self, problem_statement: str, budget: Budget) -> list[str]:
        """argv of the headless run (the runner must give it stdin = /dev/null)."""
        raise NotImplementedError

    def env(self, home: Path, gateway_url: str, api_key: str, model: str) -> dict[str, str]:
        """Environment variables (HOME as the command sees it, base URL/key, offline switches); no PATH."""
        raise NotImplementedError

    def check_script(self) -> list[ScriptedTurn]:
        """Scripted replies that make this CLI edit `hello.txt` via its own tool, then finish."""
        raise NotImplementedError

    def base_env(self, home: Path) -> dict[str, str]:
        """HOME plus the XDG folders pointing into it, and COMMON_ENV."""
        home = Path(home)
        return {**COMMON_ENV, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_CACHE_HOME": str(home / ".cache"),
                "XDG_STATE_HOME": str(home / ".local" / "state")}


def prompt_arg(problem_statement: str) -> str:
    """The problem statement as one argv element that no CLI parser mistakes for an option.

    A statement starting with `-` or `@` (pi reads `@file` arguments) gets one leading space.
    """
    return " " + problem_statement if problem_statement[:1] in ("-", "@") else problem_statement


def gateway_base(gateway_url: str, suffix: str = "") -> str:
    """`gateway_url` without a trailing slash, plus `suffix` ("/v1", "/v1beta" or "")."""
    return gateway_url.rstrip("/") + suffix


# The file every check task edits, and the content the scripted tool call writes.
CHECK_FILE = "hello.txt"
CHECK_CONTENT = "hello from the harness check"
CHECK_SHELL = f"printf '%s\\n' '{CHECK_CONTENT}' > {CHECK_FILE}"
CHECK_PROBLEM = (f"Create the file {CHECK_FILE} in the repository root containing the line "
                 f"'{CHECK_CONTENT}', then stop.")
# Read-only commands the check runs before the edit: five tool calls in all, so that merge
# fidelity is measured over a real multi-turn session.
CHECK_WARMUP = ("echo 'Grüße ✓ 日本語'", "ls", "git status --short", "printf '%s\\n' 1.0")


def check_tool_calls(tool: str, key: str = "command", *, strict_edit: bool = False,
                     **fixed: Any) -> list[ScriptedTurn]:
    """Five scripted calls of a harness's shell `tool` (`key` names its command argument),
    the last one making the check's edit.

    The arguments are the kind harnesses re-serialize before sending the history back: keys
    not in alphabetical order (`z_context`, then the `fixed` arguments, then the command), a
    nested object with floats written as `1.0` and non-ASCII text (`z_context`), and `fixed`
    arguments such as a timeout written as a float (`60000.0`).  `strict_edit`: the tool rejects
    arguments outside its schema (Claude Code), so the edit call leaves `z_context` out and the
    four calls before it come back as the harness's validation error, which the conversation
    (and its merge) carries on from.
    """
    calls = []
    for command in (*CHECK_WARMUP, CHECK_SHELL):
        args: dict[str, Any] = {}
        if not (strict_edit and command == CHECK_SHELL):
            args["z_context"] = {"weight": 1.0, "note": {"lang": "de", "text": "Grüße ✓ 日本語"}, "tags": [2.0, "ü"]}
        args.update(fixed)
        args[key] = command
        calls.append(ScriptedTurn(tool=tool, arguments=args))
    return calls
