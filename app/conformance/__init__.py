"""Conformance checks of the harness presets against the real gateway (`python -m app harness check`).

* `app.conformance.harness_check`: `run_check(name)` runs one harness CLI headless
  against a fresh gateway backed by a scripted engine and reports the captured
  calls, the API detected, merge fidelity, the diff and token hygiene.
* `app.conformance.pipeline_check`: `run_pipeline_checks(names, ...)` does the same
  through the whole pipeline (REST API, Celery worker, sandboxed runtime, grading).
* `app.conformance.scripted`: the scripted engine, a deterministic test double of the engine
  contract (run as `python -m app.conformance.scripted`); the tests and benches use it too.
* `app.conformance.scripted.check`: the scripted engine answering each preset's
  `check_script()` (run as `python -m app.conformance.scripted.check`).
* `app.conformance.servers`: the engine / gateway subprocesses both checks start.

Only the CLI (`app.cli.harness`) imports this package; the presets in
`app.harnesses` never do.
"""
