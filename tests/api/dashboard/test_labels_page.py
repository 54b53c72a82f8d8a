"""Run names, tags and notes on the dashboard, the runs list's search and live refresh, and the
TensorBoard and Flower links: headless Chromium against the real API (gunicorn) and SQL.

Waits are on conditions (`WebDriverWait`), never sleeps; every browser test fails on a SEVERE
console entry.  Rows a test adds carry a word of its own, so tests pass in any order.
"""
from __future__ import annotations

import uuid

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from app.db import session_scope
from app.tables import Run
from api.dashboard.pages import console_clean, open_page, rows, wait_until

CFG = {"harness": "mini-swe-agent", "task_set": "synthetic", "model": {"name": "smollm2"}, "steps": 2}


def _word() -> str:
    return "w" + uuid.uuid4().hex[:8]


def _run(**fields) -> int:
    with session_scope() as s:
        run = Run(kind=fields.pop("kind", "eval"), status=fields.pop("status", "completed"), config=CFG, **fields)
        s.add(run)
        s.flush()
        return run.id


def _shown(browser) -> set[int]:
    return {int(r.get_attribute("data-run")) for r in rows(browser, "#runs")}


def test_runs_list_shows_labels_and_searches_them(browser, site, shots):
    word = _word()
    named = _run(name=f"Baseline {word}", tags=[word, "baseline"], notes="first line of the notes\nsecond line")
    noted = _run(kind="train", status="failed", notes=f"tried a bigger lr ({word.upper()})")
    other = _run(name="unrelated")
    open_page(browser, site, "/")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{named}"] td.run-cell').text
    assert f"Baseline {word}" in row and "baseline" in row and "first line of the notes" in row
    assert "second line" not in row  # the list shows the notes' first line
    browser.find_element(By.ID, "run-search").send_keys(word)
    browser.find_element(By.CSS_SELECTOR, "#run-filters button").click()
    wait_until(browser, lambda d: f"q={word}" in d.current_url)
    assert _shown(browser) == {named, noted}  # in a name, a tag or the notes, any case
    browser.save_screenshot(str(shots / "runs-search.png"))
    Select(browser.find_element(By.NAME, "status")).select_by_value("failed")
    browser.find_element(By.CSS_SELECTOR, "#run-filters button").click()
    wait_until(browser, lambda d: "status=failed" in d.current_url)
    assert _shown(browser) == {noted}
    open_page(browser, site, f"/?tag={word}")
    assert _shown(browser) == {named} and other not in _shown(browser)
    open_page(browser, site, "/")
    browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{named}"] a.tag').click()  # a tag links to its runs
    wait_until(browser, lambda d: f"tag={word}" in d.current_url)
    assert _shown(browser) == {named}
    open_page(browser, site, f"/?q=nothing-{word}")
    assert "No runs match these filters" in browser.find_element(By.ID, "no-runs").text
    console_clean(browser)


def test_a_bad_filter_on_the_page_is_a_400_page(site):
    import httpx
    from support import AUTH

    resp = httpx.get(site["url"] + "/?tag=Not%20a%20tag", headers=AUTH, timeout=30)
    assert resp.status_code == 400 and "tag:" in resp.text


def test_runs_list_refreshes_live_with_its_filters(browser, site):
    """A run created after the page loaded appears without a reload, if it matches the page's
    search; a run that does not match never does; a ticked run stays ticked."""
    word = _word()
    first = _run(name=f"first {word}")
    open_page(browser, site, f"/?q={word}")
    assert _shown(browser) == {first}
    browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{first}"] input[name="compare"]').click()
    browser.execute_script("window.__notReloaded = true;")
    _run(name="does not match")
    later = _run(name=f"later {word}", status="running")
    wait_until(browser, lambda d: later in _shown(d))
    assert _shown(browser) == {first, later}
    assert browser.execute_script("return window.__notReloaded === true;")
    assert browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{first}"] input[name="compare"]').is_selected()
    with session_scope() as s:  # a state change and a new tag show too
        run = s.get(Run, later)
        run.status, run.tags = "completed", [word]
    wait_until(
        browser, lambda d: "completed" in d.find_element(By.CSS_SELECTOR, f'tr[data-run="{later}"]').text
        and word in d.find_element(By.CSS_SELECTOR, f'tr[data-run="{later}"] a.tag').text)
    assert browser.find_element(By.ID, "runs-live").text == "live"
    console_clean(browser)


def test_run_page_sets_and_clears_name_tags_and_notes(browser, site, shots):
    run_id = _run()
    open_page(browser, site, f"/runs/{run_id}")
    assert not browser.find_elements(By.ID, "run-name")
    browser.find_element(By.CSS_SELECTOR, "#run-labels summary").click()
    browser.find_element(By.ID, "label-name").send_keys("sweep lr=3e-5")
    browser.find_element(By.ID, "label-tags").send_keys("Sweep, lr-3e-5")
    browser.find_element(By.ID, "label-notes").send_keys("warm start from run 1\nsecond try")
    browser.find_element(By.CSS_SELECTOR, "#labels-form button").click()
    wait_until(browser, lambda d: d.find_elements(By.ID, "run-name"))
    assert browser.find_element(By.ID, "run-name").text == "sweep lr=3e-5"
    assert [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#run-labels-shown a.tag")] == ["lr-3e-5", "sweep"]
    assert browser.find_element(By.ID, "run-notes").text == "warm start from run 1\nsecond try"
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert (run.name, run.tags, run.notes) == ("sweep lr=3e-5", ["lr-3e-5", "sweep"], "warm start from run 1\nsecond try")
    browser.save_screenshot(str(shots / "run-labels.png"))

    # A bad tag: the API's reason on the page, what was typed kept, nothing saved
    browser.find_element(By.CSS_SELECTOR, "#run-labels summary").click()
    tags = browser.find_element(By.ID, "label-tags")
    tags.clear()
    tags.send_keys("has space")
    browser.find_element(By.CSS_SELECTOR, "#labels-form button").click()
    wait_until(browser, lambda d: "not saved" in d.find_element(By.ID, "labels-result").text)
    assert "tags.0" in browser.find_element(By.ID, "labels-result").text
    assert browser.find_element(By.ID, "label-tags").get_attribute("value") == "has space"
    with session_scope() as s:
        assert s.get(Run, run_id).tags == ["lr-3e-5", "sweep"]

    # Cleared: every field empty
    for field in ("label-name", "label-tags", "label-notes"):
        browser.find_element(By.ID, field).clear()
    browser.find_element(By.CSS_SELECTOR, "#labels-form button").click()
    wait_until(browser, lambda d: not d.find_elements(By.ID, "run-name"))
    assert not browser.find_elements(By.ID, "run-labels-shown")
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert (run.name, run.tags, run.notes) == (None, None, None)
    # the failed save logged its 400 response: that entry is the only console error allowed
    console_clean(browser, allowed=(f"/api/runs/{run_id}",))


def test_links_say_when_no_address_is_set(browser, site):
    run_id = _run()
    open_page(browser, site, f"/runs/{run_id}")
    links = browser.find_element(By.ID, "monitoring-links")
    assert "TensorBoard: no address set" in links.text and "Flower: no address set" in links.text
    assert not links.find_elements(By.TAG_NAME, "a")  # no dead link
    console_clean(browser)


@pytest.fixture
def configured(site, monkeypatch):
    from app import config

    monkeypatch.setenv("TURNSTILE_TENSORBOARD_URL", "http://tb.example:6006")
    monkeypatch.setenv("TURNSTILE_FLOWER_URL", "http://flower.example:5555/")
    config.reset_settings()
    yield
    monkeypatch.undo()
    config.reset_settings()


def test_links_go_to_the_runs_tensorboard_run_and_to_flower(configured):
    """Rendered by the app in this process, which reads the two addresses from its settings."""
    import re

    from app import create_app
    from support import api_client

    run_id = _run(kind="train", name="my run")
    client = api_client(create_app({"TESTING": True}))
    page = client.get(f"/runs/{run_id}").get_data(as_text=True)
    tb = f"http://tb.example:6006/?runFilter=%5E{run_id}-my-run%24#timeseries"
    assert re.findall(r'<span id="tensorboard-link"><a href="([^"]+)"', page) == [tb]
    assert re.findall(r'<span id="flower-link"><a href="([^"]+)"', page) == ["http://flower.example:5555/"]
    listing = client.get("/").get_data(as_text=True)
    row = listing[listing.index(f'<tr data-run="{run_id}">'):]
    assert re.findall(r'<td class="tb-link"><a href="([^"]+)"', row[:row.index("</tr>")]) == [tb]
