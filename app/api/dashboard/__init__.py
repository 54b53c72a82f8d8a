"""The dashboard: HTML pages served by the API process at `/` (runs, run, episode, compare, submit).

Pages are rendered on the server from SQL (`data.py`); the browser adds the per-step charts
(uPlot, vendored under `static/vendor/` at a pinned version with its licence), live refresh of a
running run, the cancel button and the submit form's request, all through the REST API.
"""
from __future__ import annotations

from app.api.dashboard.views import bp

__all__ = ["bp"]
