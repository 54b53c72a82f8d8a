"""The run page in every state a run, a step or an episode can be in, and a live page whose refresh fails.

Headless Chromium against the real API (gunicorn) over the seeded runs of
`support.dashboard_seed.seed_states`; every page must answer 200 and leave no SEVERE console entry.
"""
from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from api.dashboard.pages import console_clean, open_page, rows, text, wait_until
from app.db import session_scope
from app.tables import EPISODE_STATES, Episode


@pytest.mark.parametrize("label, status", [
    ("live_train", "running"), ("pending_train", "running"), ("failed_train", "failed"),
    ("queued_eval", "queued"), ("queued_train", "queued"), ("cancelling_eval", "cancelling"),
    ("cancelled_train", "cancelled"),
])
def test_every_run_state_renders(browser, site, shots, label, status):
    run_id = site["ids"][label]
    open_page(browser, site, f"/runs/{run_id}")
    assert status in text(browser, "#run-head h1")
    assert ("live-indicator" in browser.page_source) == (status not in ("failed", "cancelled"))
    if label == "queued_train":  # just submitted: a normal wait
        assert "no control worker has started it yet" in text(browser, "#run-hint")
        assert not browser.find_elements(By.ID, "run-waiting")
    if label == "queued_eval":  # 3 hours queued: past a lease plus a watchdog period, said in red
        waiting = text(browser, "#run-waiting")
        assert "no control worker has taken this run in" in waiting and "900 s watchdog period" in waiting
        assert f"turnstile cancel {run_id}" in waiting and not browser.find_elements(By.ID, "run-hint")
    if status == "queued":
        assert "No episodes" in text(browser, "#no-episodes")
    if status == "cancelling":
        assert "Cancel requested" in text(browser, "#run-hint")
    if status == "failed":
        assert "CUDA out of memory" in text(browser, "#run-error")
    browser.save_screenshot(str(shots / f"run-{label}.png"))
    console_clean(browser)


def test_steps_still_pending_or_training_show_without_their_metrics(browser, site):
    """The bug this guards: the steps table formatted a metric an unfinished step lacks (HTTP 500)."""
    open_page(browser, site, f"/runs/{site['ids']['pending_train']}")
    assert "No completed training steps yet (step 0 is pending)" in text(browser, "#no-steps")
    step = rows(browser, "#steps")
    assert len(step) == 1 and "pending" in step[0].text and "-" in step[0].text
    open_page(browser, site, f"/runs/{site['ids']['live_train']}")
    by_step = {r.get_attribute("data-step"): r for r in rows(browser, "#steps")}
    browser.find_element(By.CSS_SELECTOR, "#steps-details summary").click()
    assert "training" in by_step["2"].text and "completed" in by_step["0"].text
    kl = by_step["0"].find_elements(By.TAG_NAME, "td")[7]  # step, status, version, episodes, reward, resolved, loss, kl
    assert kl.text == "n/c" and kl.get_attribute("title") == "not computed: kl_coef is 0"
    open_page(browser, site, f"/runs/{site['ids']['failed_train']}")
    browser.find_element(By.CSS_SELECTOR, "#steps-details summary").click()
    failed = {r.get_attribute("data-step"): r.text for r in rows(browser, "#steps")}
    assert "failed" in failed["1"] and "CUDA out of memory" in failed["1"]
    console_clean(browser)


def test_episodes_in_every_state_are_listed(browser, site):
    open_page(browser, site, f"/runs/{site['ids']['live_train']}")
    shown = {r.find_elements(By.TAG_NAME, "td")[4].text.split()[0] for r in rows(browser, "#episodes")}
    assert shown == set(EPISODE_STATES)
    console_clean(browser)


def test_every_episode_page_renders(browser, site):
    """One episode page per (run, status) pair the seed holds: each answers 200 and draws cleanly."""
    with session_scope() as s:
        seen, picks = set(), []
        for e in s.query(Episode).order_by(Episode.id):
            if (e.run_id, e.status) not in seen:
                seen.add((e.run_id, e.status))
                picks.append(e.id)
    for episode_id in picks:
        open_page(browser, site, f"/episodes/{episode_id}")
        assert f"Episode #{episode_id}" in text(browser, "h1")
    console_clean(browser)


def test_a_failed_refresh_says_so_then_recovers(browser, site, shots):
    """A page whose refresh fails marks itself stale instead of going on saying "live"."""
    open_page(browser, site, f"/runs/{site['ids']['live_train']}")
    assert text(browser, "#live-indicator") == "live"
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/api/runs/*"]})
    try:
        wait_until(browser, lambda d: "refresh failed" in text(d, "#live-indicator"))
        assert "stale" in browser.find_element(By.ID, "live-indicator").get_attribute("class")
        browser.save_screenshot(str(shots / "run-refresh-failed.png"))
    finally:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
    wait_until(browser, lambda d: text(d, "#live-indicator") == "live")
    console_clean(browser, allowed=("ERR_BLOCKED_BY_CLIENT",))


pytestmark = pytest.mark.timeout(300)


def test_the_runs_of_one_learn_sequence_link_to_each_other(browser, site):
    ids = site["ids"]
    before, train, after = ids["eval_base"], ids["train"], ids["eval_trained"]
    for current in (before, train, after):
        open_page(browser, site, f"/runs/{current}")
        series = text(browser, "#run-series")
        assert series.startswith("made together by turnstile learn:"), series
        parts = [f"{role} #{i} ({kind}, completed{', this run' if i == current else ''})"
                 for role, i, kind in (("before", before, "eval"), ("train", train, "train"), ("after", after, "eval"))]
        assert " → ".join(parts) in series, series
        links = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#run-series a[href^='/runs/']")}
        assert links == {f"#{i}" for i in (before, train, after) if i != current}
        compare = browser.find_element(By.ID, "series-compare").get_attribute("href")
        assert compare.endswith(f"/compare?a={before}&b={after}")
    open_page(browser, site, f"/runs/{train}")  # and by checkpoint: the after eval starts from this run
    assert f"#{after} (eval, completed)" in text(browser, "#run-related")
    open_page(browser, site, f"/runs/{ids['live_train']}")
    assert not browser.find_elements(By.ID, "run-series")  # a run made alone links to none
    console_clean(browser)
