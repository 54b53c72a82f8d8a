"""Command line (`turnstile`, also `python -m app`): submit and follow runs, list them, export them, compare them, and the demo.

Talks to the REST API (TURNSTILE_API_URL), so it works against a remote deployment as well as
the local one.  Settings, `.env` included, come from `app.config` like in every other process.
Each command module has a `register(sub)` that adds its sub-commands; they share
`app.cli.client` (API client, run configs, following runs), `app.cli.report` (what is
printed) and `app.cli.pulls` (image pulls with progress), never each other.
"""
from __future__ import annotations

import argparse
import sys

from app.cli import compare as compare_cmds
from app.cli import deploy as deploy_cmds
from app.cli import harness as harness_cmds
from app.cli import images as images_cmds
from app.cli import label as label_cmds
from app.cli import learning as learning_cmds
from app.cli import model as model_cmds
from app.cli import runs as runs_cmds
from app.cli import tasks as tasks_cmds
from app.cli import token as token_cmds


PROG = "turnstile"  # the console script (pyproject.toml [project.scripts]); `python -m app` is the same program


def build_parser() -> argparse.ArgumentParser:
    """The `turnstile` parser: every command module's sub-commands, in help order."""
    parser = argparse.ArgumentParser(prog=PROG, description="Turnstile: GRPO for unmodified coding agents")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (runs_cmds, label_cmds, compare_cmds, model_cmds, tasks_cmds, images_cmds, learning_cmds, token_cmds, harness_cmds,
                   deploy_cmds):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import httpx

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except httpx.HTTPStatusError as exc:
        try:
            message = exc.response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.response.text[:300]
        print(f"error: {exc.request.method} {exc.request.url.path}: {exc.response.status_code} {message}", file=sys.stderr)
        if exc.response.status_code == 401:
            print("hint: the CLI sends TURNSTILE_API_TOKEN, else the token in <TURNSTILE_VAR_DIR>/api_token; "
                  "it must be the API server's", file=sys.stderr)
        return 1
    except httpx.TimeoutException as exc:
        # The API answered the connection but not in time: it is up, the request was slow (a first
        # export, a large listing).  Saying "cannot reach" would send the user to restart it.
        from app.config import get_settings

        print(f"error: the Turnstile API at {get_settings().api_url} took too long to answer "
              f"{_request_of(exc)}({type(exc).__name__}); it is running: try again, or look at its log",
              file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        from app.config import get_settings

        print(f"error: cannot reach the Turnstile API at {get_settings().api_url} ({exc}); "
              "is it running (`make up`), and is TURNSTILE_API_URL right?", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _request_of(exc) -> str:
    """`GET /api/runs/1/export ` of an httpx error, or "" when it carries no request."""
    try:
        return f"{exc.request.method} {exc.request.url.path} "
    except RuntimeError:  # httpx raises this for an error made without a request
        return ""
