"""The run page's "Settings chosen" section (`_provenance.html`) in headless Chromium, against the
real API under gunicorn: a run made through the API with the CLI's claim, and a run from before
sources were recorded."""
from __future__ import annotations

import json

import httpx
from selenium.webdriver.common.by import By

from app.db import session_scope
from app.provenance import HEADER, record
from app.runconfig import RunConfig
from app.tables import Run
from api.dashboard.pages import console_clean, open_page, rows, text
from support import AUTH


def _submit(site, body: dict, claim: dict) -> int:
    resp = httpx.post(site["url"] + "/api/runs", json=body, headers={**AUTH, HEADER: json.dumps(claim)}, timeout=30)
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def test_the_run_page_names_each_chosen_settings_source(site, browser):
    body = {"kind": "eval", "task_set": "synthetic", "model": {"name": "tiny", "checkpoint": None},
            "group_size": 2, "simulate": {"episode_median_s": 0.1}}
    claim = {"kind": "--set", "task_set": "file", "model.name": "file", "model.checkpoint": "warm start"}
    run_id = _submit(site, body, claim)
    open_page(browser, site, f"/runs/{run_id}")
    table = {r.get_attribute("data-path"): r.find_elements(By.TAG_NAME, "td") for r in rows(browser, "#provenance-table")}
    shown = {path: (cells[1].text, cells[2].text) for path, cells in table.items()}
    assert shown["kind"] == ('"eval"', "--set")
    assert shown["task_set"] == ('"synthetic"', "file") and shown["model.name"] == ('"tiny"', "file")
    assert shown["model.checkpoint"] == ("null", "warm start")
    assert shown["group_size"] == ("2", "api") and shown["simulate.episode_median_s"] == ("0.1", "api")
    assert "scheduling.share" not in shown and "training.learning_rate" not in shown  # defaults: counted, not listed
    api = httpx.get(f"{site['url']}/api/runs/{run_id}", headers=AUTH, timeout=30).json()["provenance"]
    defaults = sum(1 for source in api.values() if source == "default")
    assert f"{defaults} other settings kept their defaults" in text(browser, "#provenance")
    console_clean(browser)


def test_a_run_from_before_provenance_says_so(site, browser):
    open_page(browser, site, f"/runs/{site['ids']['train']}")
    assert "created before the sources of its settings were recorded" in text(browser, "#provenance-none")
    assert not browser.find_elements(By.CSS_SELECTOR, "#provenance-table")
    console_clean(browser)


def test_a_run_of_defaults_only_says_nobody_chose(site, browser):
    # an empty body is a full fine-tune train run, which the seed's LoRA runs on these engines refuse
    # over the API; its row as the API would write it
    stored = RunConfig.model_validate({}).model_dump(mode="json")
    with session_scope() as s:
        run = Run(kind="train", config=stored, provenance=record(stored, {}))
        s.add(run)
        s.flush()
        run_id = run.id
    open_page(browser, site, f"/runs/{run_id}")
    assert "every one is its default" in text(browser, "#provenance-all-defaults")
    console_clean(browser)
