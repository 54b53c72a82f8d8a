"""Harness presets: one small module per unmodified coding-agent CLI (see `app.harnesses.base`).

    from app.harnesses import get_preset, PRESETS
    preset = get_preset("codex")          # ValueError for an unknown name, listing the known ones

Names match `app.runconfig.HARNESSES`.
"""
from __future__ import annotations

from pathlib import Path

from app.harnesses.base import HarnessInstallError, HarnessPreset, ScriptedTurn
from app.harnesses.claude_code import ClaudeCode
from app.harnesses.codex import Codex
from app.harnesses.gemini_cli import GeminiCli
from app.harnesses.mini_swe_agent import MiniSweAgent
from app.harnesses.opencode import OpenCode
from app.harnesses.pi import Pi
from app.harnesses.qwen_code import QwenCode

_CLASSES: tuple[type[HarnessPreset], ...] = (MiniSweAgent, Codex, ClaudeCode, QwenCode, GeminiCli, OpenCode, Pi)

# name -> preset using the shared tools folder (<var_dir>/tools or TURNSTILE_TOOLS_DIR)
PRESETS: dict[str, HarnessPreset] = {cls.name: cls() for cls in _CLASSES}


def get_preset(name: str, tools: Path | None = None) -> HarnessPreset:
    """The preset called `name` (optionally bound to another tools folder).

    Raises ValueError naming the known presets when `name` is unknown.
    """
    for cls in _CLASSES:
        if cls.name == name:
            return PRESETS[name] if tools is None else cls(tools=Path(tools))
    raise ValueError(f"unknown harness {name!r}; choose one of {', '.join(PRESETS)}")


__all__ = ["PRESETS", "get_preset", "HarnessPreset", "HarnessInstallError", "ScriptedTurn"]
