"""What every CLI command shares: the REST API client, run configs, submitting and following runs.

The command modules (`runs`, `compare`, `learning`, …) import this module and `app.cli.report`,
never each other (an import-linter `independence` contract checks it).  Everything here goes
through the REST API (TURNSTILE_API_URL), so it works against a remote deployment too.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from app.cli.report import make_console, render_summary
from app.config import get_settings


# Seconds an export may go without a line: the API writes each episode as it reads it, but the
# first export after the API starts may first build the tokenizer cache (about 10 s).
EXPORT_READ_TIMEOUT_S = 300.0


def api_client() -> httpx.Client:
    """An HTTP client of the REST API that sends the API token (`app.auth.api_token`)."""
    from app.auth import auth_header

    return httpx.Client(base_url=get_settings().api_url, timeout=30, headers=auth_header())


def read_config_file(path: str) -> dict:
    """A run config from a JSON, YAML (`.yaml`/`.yml`) or TOML (`.toml`) file, by its suffix.

    Raises ValueError naming the file on a parse error or when the top level is not a mapping,
    OSError when it cannot be read.
    """
    import tomllib

    import yaml

    text = Path(path).read_text()
    suffix = Path(path).suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            config = yaml.safe_load(text)
        elif suffix == ".toml":
            config = tomllib.loads(text)
        else:
            config = json.loads(text)
    except yaml.MarkedYAMLError as exc:  # multi-line by default: keep the problem and its position
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML: {exc.problem or exc.context}{where}") from None
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        kind = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}.get(suffix, "JSON")
        raise ValueError(f"{path}: not valid {kind}: {' '.join(str(exc).split())}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a run config must be a mapping of options, got {type(config).__name__}")
    return config


def check_run(config: dict, origins: dict[str, str]) -> list[dict]:
    """Every `{"field", "message"}` problem the API finds in `config` (schema and this installation's
    checks, `POST /api/runs?dry_run=1`, which creates nothing); [] when it would be accepted."""
    from app.provenance import HEADER

    with api_client() as api:
        resp = api.post("/api/runs", params={"dry_run": "1"}, json=config, headers={HEADER: json.dumps(origins)})
    if resp.status_code == 200:
        return []
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"run check failed ({resp.status_code}): {resp.text[:300]}") from None
    return error.get("details") or [{"field": error.get("field"), "message": error.get("message")}]


def submit_run(config: dict, origins: dict[str, str] | None = None) -> dict:
    """POST the config; returns the created run, or raises SystemExit with the API's error message.

    `origins` (`{dotted path: source}`, `app.provenance`) tells the API which settings came from a
    file, `--set` or the warm start; without it every setting sent is recorded as the API body's.
    """
    from app.provenance import HEADER

    headers = {HEADER: json.dumps(origins)} if origins else {}
    with api_client() as client:
        resp = client.post("/api/runs", json=config, headers=headers)
    if resp.status_code != 202:
        err = resp.json().get("error", {}) if resp.headers.get("content-type", "").startswith("application/json") else {}
        details = err.get("details") or []
        if len(details) > 1:  # every problem of the request, not only the first
            lines = [f"  {d['field']}: {d['message']}" if d.get("field") else f"  {d['message']}" for d in details]
            raise SystemExit(f"run rejected ({resp.status_code}): {len(details)} problems in the run config\n" + "\n".join(lines))
        raise SystemExit(f"run rejected ({resp.status_code}): {err.get('message', resp.text)}")
    return resp.json()


def _when(value: str | None):
    import datetime as dt

    if not value:
        return None
    when = dt.datetime.fromisoformat(value)
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)


def running_s(run: dict) -> float | None:
    """Seconds the run has been running: from `started_at` to `finished_at` (or now); None while it
    has not started (queued).  Not the run's age: a run that waited an hour in the queue and ran
    for a minute ran for a minute."""
    import datetime as dt

    started = _when(run.get("started_at"))
    if started is None:
        return None
    end = _when(run.get("finished_at")) or dt.datetime.now(dt.timezone.utc)
    return max(0.0, (end - started).total_seconds())


def _elapsed(run: dict) -> str:
    seconds = running_s(run)
    return "not started" if seconds is None else f"{seconds:.0f} s"


def _progress_table(run: dict) -> Table:
    table = Table(title=f"run {run['id']} ({run['kind']}) — {run['status']}", expand=False)
    for col in ("state", "episodes"):
        table.add_column(col)
    from app.tables import EPISODE_STATES  # lazily: a CLI command that shows no progress loads no SQL models

    counts = run.get("episodes_by_status", {})
    for state in EPISODE_STATES:
        if counts.get(state):
            table.add_row(state, str(counts[state]))
    live = run.get("live") or {}
    steps = run.get("steps") or []
    done = [s for s in steps if s["status"] == "completed"]
    table.add_section()
    table.add_row("policy version", str(run.get("policy_version")))
    table.add_row("steps done", f"{len(done)}/{run['config'].get('steps')}" if run["kind"] == "train" else "-")
    if done and done[-1].get("metrics"):
        m = done[-1]["metrics"]
        if m.get("reward_mean") is not None:
            table.add_row("last step reward", f"{m['reward_mean']:.3f}")
    if live.get("reward_mean") is not None:
        table.add_row("reward (graded)", f"{live['reward_mean']:.3f} over {live['graded']}")
    table.add_row("completions", str(live.get("completions", 0)))
    seconds = running_s(run)
    if seconds:
        table.add_row("sampled tokens/s", f"{live.get('sampled_tokens', 0) / seconds:.1f}")
    table.add_row("elapsed (running)", _elapsed(run))
    if (run.get("trainer") or {}).get("text"):
        table.add_row("trainer", run["trainer"]["text"])
    if heldout_text(run):
        table.add_row("held-out", heldout_text(run))
    if run.get("waiting"):
        table.add_row("[bold red]waiting[/bold red]", run["waiting"])
    return table


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def step_line(step: dict) -> str:
    """One line for a completed training step (API shape): reward, loss, the trainer-vs-rollout
    logprob gap (max and mean |Δ| over tokens the trainer's own weights sampled, nats), time."""
    m = step.get("metrics") or {}
    return (f"step {step['step']} trained: reward {_num(m.get('reward_mean'), '.3f')}, loss {_num(m.get('loss'), '.4f')}, "
            f"logprob gap max {_num(m.get('logprob_gap_max_abs'), '.2e')} mean {_num(m.get('logprob_gap_mean_abs'), '.2e')}, "
            f"{_num(m.get('step_time_s'), '.1f')} s, policy version {_num(step.get('policy_version'), 'd')}")


def heldout_text(run: dict) -> str | None:
    """The held-out eval in progress, or the latest finished one (API `heldout`), in words; None
    when the run has none made yet."""
    made = [p for p in run.get("heldout") or [] if p.get("run_id")]
    if not made:
        return None
    live = next((p for p in made if p["status"] not in ("completed", "failed", "cancelled")), None)
    p = live or made[-1]
    text = f"held-out eval of step {p['step']} (run {p['run_id']}) {p['status']}"
    if p.get("episodes_total"):
        text += f", {p['episodes_done']}/{p['episodes_total']} episodes"
    if p["status"] == "completed" and p.get("pass_at_1") is not None:
        text += f", pass@1 {p['pass_at_1']:.3f}"
    return text


def _follow_key(run: dict) -> str:
    """What must change for a piped `follow` to print again: the line without its seconds."""
    trainer = run.get("trainer") or {}
    return "|".join([progress_line(run).split("; elapsed", 1)[0], str(trainer.get("state")), str(trainer.get("step")),
                     heldout_text(run) or "", "waiting" if run.get("waiting") else ""])


def progress_line(run: dict) -> str:
    """One line of progress for logs and pipes: status, episodes by state, steps, reward, time
    running, the trainer (`trainer` of the API) and the held-out eval; then, for a run no worker
    has taken, why it waits (`waiting` of the API)."""
    from app.tables import EPISODE_STATES

    counts = run.get("episodes_by_status") or {}
    parts = [f"run {run['id']} {run['status']}",
             "episodes " + (", ".join(f"{k} {counts[k]}" for k in EPISODE_STATES if counts.get(k)) or "none yet")]
    if run["kind"] == "train":
        done = sum(1 for st in run.get("steps") or [] if st["status"] == "completed")
        parts.append(f"steps {done}/{run['config'].get('steps')}")
    live = run.get("live") or {}
    if live.get("reward_mean") is not None:
        parts.append(f"reward {live['reward_mean']:.3f} over {live['graded']}")
    parts.append(f"elapsed {_elapsed(run)}")
    if (run.get("trainer") or {}).get("text"):
        parts.append(f"trainer: {run['trainer']['text']}")
    if heldout_text(run):
        parts.append(heldout_text(run))
    line = "; ".join(parts)
    return f"{line}\n  waiting: {run['waiting']}" if run.get("waiting") else line


def follow_run(run_id: int, poll_s: float = 1.0, timeout_s: float | None = None, console: Console | None = None) -> dict:
    """Poll the run and show live progress until it ends; returns the final run dict.

    On a terminal the progress is a live table; otherwise (a pipe, a log file, CI) one line is
    printed whenever the progress changes.  Ctrl-C stops following, not the run: it raises
    `FollowInterrupted`, whose message says how to follow again or cancel.
    """
    console = console or make_console()
    started = time.monotonic()
    shown_steps: set[int] = set()

    def new_steps(run: dict) -> list[str]:
        """`step_line` of each step completed since the last poll, once."""
        lines = []
        for st in run.get("steps") or []:
            if st["status"] == "completed" and st["step"] not in shown_steps:
                shown_steps.add(st["step"])
                lines.append(step_line(st))
        return lines

    try:
        with api_client() as client:
            if console.is_terminal:
                with Live(console=console, refresh_per_second=2, transient=False) as live:
                    def update(run: dict) -> None:
                        for line in new_steps(run):
                            live.console.print(line, markup=False, highlight=False)
                        live.update(_progress_table(run))

                    return _poll(client, run_id, poll_s, timeout_s, started, update)
            last: list[str] = []

            def show(run: dict) -> None:
                for line in new_steps(run):
                    print(line, flush=True)
                key = _follow_key(run)
                if [key] != last:  # print on change, not every poll (the seconds alone are no change)
                    last[:] = [key]
                    print(progress_line(run), flush=True)

            return _poll(client, run_id, poll_s, timeout_s, started, show)
    except KeyboardInterrupt:
        raise FollowInterrupted(run_id) from None


class FollowInterrupted(KeyboardInterrupt):
    """Ctrl-C while following: the run goes on; the message says how to get back to it."""

    def __init__(self, run_id: int):
        super().__init__(f"stopped following; run {run_id} continues. Follow it again with `turnstile follow {run_id}`, "
                         f"cancel it with `turnstile cancel {run_id}`.")


def _poll(client, run_id: int, poll_s: float, timeout_s: float | None, started: float, show) -> dict:
    from app.transitions import TERMINAL

    while True:
        run = client.get(f"/api/runs/{run_id}").raise_for_status().json()
        show(run)
        if run["status"] in TERMINAL:
            return run
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise SystemExit(f"run {run_id} still {run['status']} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def dashboard_url(run_id: int) -> str:
    """The run's dashboard page (`<TURNSTILE_API_URL>/runs/<id>`)."""
    return f"{get_settings().api_url.rstrip('/')}/runs/{run_id}"


def steps_table(run: dict) -> Table:
    """The training steps of a run still going (API shape `steps`): state, version, episodes,
    reward, loss; "-" for what a step has not produced yet."""
    table = Table(title="training steps")
    for col in ("step", "status", "ver", "episodes", "reward", "loss", "error"):
        table.add_column(col)
    for st in run.get("steps") or []:
        m = st.get("metrics") or {}
        reward, loss = m.get("reward_mean"), m.get("loss")
        table.add_row(str(st["step"]), st["status"], "-" if st.get("policy_version") is None else str(st["policy_version"]),
                      str(len(st.get("episode_ids") or [])), "-" if reward is None else f"{reward:.3f}",
                      "-" if loss is None else f"{loss:.4f}", st.get("error") or "")
    return table


def print_summary(run: dict, console: Console | None = None) -> None:
    """Print the end-of-run summary of `run` (API shape) to `console` (default: the CLI's)."""
    render_summary(run, console or make_console())


def follow_to_end(run_id: int, timeout_s: float | None) -> int:
    """Follow, then print the summary; 0 when the run completed, 1 when not, 130 on Ctrl-C."""
    try:
        final = follow_run(run_id, timeout_s=timeout_s)
    except FollowInterrupted as exc:
        print(exc, file=sys.stderr)
        return 130
    print_summary(final)
    return 0 if final["status"] == "completed" else 1


def samples_of(episodes: Sequence[Mapping]) -> dict[str, list[bool]]:
    """Resolved flags per instance from a run's episodes (API shape): completed by `resolved`, failed as False.

    Every episode that ended counts as one sample: `failed` ones (harness failure, setup error)
    as not resolved, so the metric is the resolved rate of what the policy was asked to do.
    Cancelled and unfinished episodes are left out.
    """
    out: dict[str, list[bool]] = {}
    for ep in episodes:
        if ep.get("status") == "completed":
            out.setdefault(ep["instance_id"], []).append(bool(ep.get("resolved")))
        elif ep.get("status") == "failed":
            out.setdefault(ep["instance_id"], []).append(False)
    return out


def run_samples(client: httpx.Client, run_id: int) -> dict[str, list[bool]]:
    """`samples_of` the episodes of run `run_id`, read from the API."""
    return samples_of(client.get(f"/api/runs/{run_id}/episodes").raise_for_status().json()["episodes"])
