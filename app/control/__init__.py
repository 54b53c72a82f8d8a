"""The control loop as plain code: it decides and commits, and returns a `Plan` of what to send.

Read in this order:

* `plan`       — `Plan`: the messages to send next (the task layer sends them after commit)
* `state`      — the Redis state: READY buffer, slots, cancel flags, dirty marks, the run lock
* `stages`     — the interface of a stage's work; `real_stages` and `simulated_stages` implement it
* `runs`       — run start, and `stages_for` (which implementation a run gets)
* `scheduler`  — `tick(run_id)`: groups, dispatch, staleness, steps, finishing
* `lease`      — a stage's lease on its episode row: claim, renew (heartbeat), hold
* `episodes`   — an episode's claims and transitions: prepare → READY → rollout → grade
* `reaper`     — expired leases re-dispatched or failed; Redis state rebuilt from SQL
* `watchdog`   — orphaned training steps, the reaper's pass; ticks every running run
* `preflight`  — what this installation can serve, checked before a run is created
* `summary`    — the run summary and per-step scheduling metrics, from SQL

Nothing here imports Celery or `app.tasks` (an import-linter contract checks it).
"""
