"""TensorBoard over `<var_dir>/tensorboard/`: link every run's events first, then exec TensorBoard.

    python -m workers.tensorboard --host 127.0.0.1 --port 6006      # the Procfile's `tensorboard`

Runs written before TensorBoard read that folder (their events only in `<var_dir>/runs/<id>/`)
get their links here (`app.tensorboard_runs.link_all`), so they stay readable; later writes and
renames keep the links up to date themselves.  The remaining arguments go to TensorBoard as given.
"""
from __future__ import annotations

import logging
import os
import sys

from app.tensorboard_runs import link_all, logdir


def _runs() -> list[tuple[int, str | None, str | None, str | None]]:
    """(id, kind, harness, name) of every run in the database; [] when it cannot be read (the
    folders are then linked by their names)."""
    try:
        from app.db import session_scope
        from app.tables import Run

        with session_scope() as s:
            return [(i, kind, harness, name) for i, kind, harness, name in
                    s.execute(s.query(Run.id, Run.kind, Run.config["harness"].as_string(), Run.name).statement)]
    except Exception:  # noqa: BLE001 - TensorBoard starts anyway
        logging.getLogger("turnstile.tracking").warning("event=tensorboard_runs_unreadable", exc_info=True)
        return []


def main(argv: list[str]) -> None:
    folder = logdir()
    folder.mkdir(parents=True, exist_ok=True)
    n = link_all(_runs())
    print(f"tensorboard: {n} runs linked under {folder}", file=sys.stderr, flush=True)
    program = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    os.execv(program, [program, "--logdir", str(folder), *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
