"""Run a program with `{setting}` placeholders in its arguments filled from `app.config`.

    python -m workers.launch .venv/bin/celery -A app worker -c {cpu_concurrency} --loglevel {log_level}

The Procfile's non-Python command lines use it, so that their values come from the
same settings (environment, then `.env`, then defaults) as every Python process,
instead of from shell expansion.  A placeholder is a settings field name
(`python -m app.config` lists them); an unknown one is an error.  The program
replaces this process (exec), so signals from the process manager reach it directly.
"""
from __future__ import annotations

import os
import string
import sys

from app.config import Settings, SettingsError, get_settings


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


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m workers.launch PROGRAM [ARG...]  (ARGs may hold {setting} placeholders)")
    try:
        args = expand(argv, get_settings())
    except SettingsError as exc:
        sys.exit(f"error: {exc}")
    os.execvp(args[0], args)


if __name__ == "__main__":
    main(sys.argv[1:])
