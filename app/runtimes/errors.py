"""Errors raised while preparing or using a runtime."""
from __future__ import annotations


class RuntimeSetupError(RuntimeError):
    """A runtime could not be prepared (download, hash, unpack, bug_patch, commit id, venv install).

    `stage` names the step that failed; the message carries the command output when there is one.
    """

    def __init__(self, stage: str, message: str):
        self.stage = stage
        super().__init__(f"{stage}: {message}")


class RuntimeClosed(RuntimeError):
    """The runtime was closed; its workspace no longer exists."""
