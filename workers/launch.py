"""Run a Procfile program with `{setting}` placeholders filled from `app.config`, restarting it when it dies.

    python -m workers.launch .venv/bin/celery -A app worker -c {cpu_concurrency} --loglevel {log_level}
    python -m workers.launch --once PROGRAM ARG...      # fill the placeholders, then exec (no restarts)

Placeholders: a settings field name (`python -m app.config` lists them) in braces; an unknown one is an
error.  Values come from the same settings (environment, then `.env`, then defaults) as every Python
process, instead of from shell expansion.

Supervision: honcho (the Procfile runner of `make up` and the demo) stops *every* process as soon as
one exits, so one crashed worker would take the whole stack down.  The launcher therefore runs the
program as a child in its own process group and restarts it whenever it exits, after a backoff that
starts at `TURNSTILE_RESTART_BACKOFF_S` and doubles per quick successive exit up to 30 s (reset once
the child has run `STABLE_S` seconds).  SIGTERM / SIGINT / SIGHUP to the launcher are passed to the
child's process group and end supervision: the launcher waits for the child and exits with its status.
The child gets SIGTERM if the launcher itself is killed, and the launcher if its parent (the process
manager) is (Linux `PR_SET_PDEATHSIG`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import string
import subprocess
import sys
import time

from app.config import Settings, SettingsError, get_settings

STABLE_S = 60.0
MAX_BACKOFF_S = 30.0
PR_SET_PDEATHSIG = 1


def expand(args: list[str], settings: Settings) -> list[str]:
    """`args` with each `{field}` replaced by that setting's value (lists comma-joined)."""
    out = []
    for arg in args:
        fields = [name for _, name, _, _ in string.Formatter().parse(arg) if name is not None]
        values = {}
        for name in fields:
            if name not in Settings.model_fields:
                raise SettingsError(f"{arg!r}: {{{name}}} is not a setting (python -m app.config lists them)")
            value = getattr(settings, name)
            values[name] = ",".join(value) if isinstance(value, list) else "" if value is None else value
        out.append(arg.format(**values) if fields else arg)
    return out


def backoff_s(quick_exits: int, first_s: float) -> float:
    """Seconds to wait before restart number `quick_exits` (1, 2, …) of a child that keeps dying:
    `first_s * 2**(quick_exits - 1)`, at most `MAX_BACKOFF_S`."""
    return min(MAX_BACKOFF_S, first_s * 2 ** max(0, quick_exits - 1))


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _log(message: str) -> None:
    print(f"launch[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


def supervise(args: list[str], first_backoff_s: float) -> int:
    """Run `args` until a stop signal arrives, restarting it whenever it exits; returns its last status."""
    stop = {"signal": None}
    child: subprocess.Popen | None = None

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum
        if child is not None and child.poll() is None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    _die_with_parent()  # the launcher too: a process manager killed with SIGKILL leaves nothing running
    quick_exits = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(args, process_group=0, preexec_fn=_die_with_parent)
        if stop["signal"] is not None:  # a signal that came while the child was being started
            on_signal(stop["signal"], None)
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
        if stop["signal"] is not None:
            return 128 + stop["signal"] if code < 0 else code
        ran = time.monotonic() - started
        quick_exits = 0 if ran >= STABLE_S else quick_exits + 1
        delay = backoff_s(max(1, quick_exits), first_backoff_s)
        _log(f"{args[0]} (pid {child.pid}) exited with status {code} after {ran:.1f} s; restarting in {delay:.1f} s")
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and stop["signal"] is None:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if stop["signal"] is not None:
            return 128 + stop["signal"]


def main(argv: list[str]) -> None:
    once = bool(argv) and argv[0] == "--once"
    if once:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m workers.launch [--once] PROGRAM [ARG...]  (ARGs may hold {setting} placeholders)")
    try:
        settings = get_settings()
        args = expand(argv, settings)
    except SettingsError as exc:
        sys.exit(f"error: {exc}")
    if once:
        os.execvp(args[0], args)
    sys.exit(supervise(args, settings.restart_backoff_s))


if __name__ == "__main__":
    main(sys.argv[1:])
