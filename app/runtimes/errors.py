"""Errors raised while preparing or using a runtime."""
from __future__ import annotations

# Defined in the bottom layer beside `git`, which raises it (see `app.gitutil`).
from app.gitutil import RuntimeSetupError

__all__ = ["RuntimeSetupError", "RuntimeClosed"]


class RuntimeClosed(RuntimeError):
    """The runtime was closed; its workspace no longer exists."""
