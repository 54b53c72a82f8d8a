"""GRPO groups on the run page and the episode page, in headless Chromium over the seeded live train run."""
from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from api.dashboard.pages import console_clean, open_page, rows, text
from app.advantages import group_advantages
from app.db import session_scope
from app.tables import Episode


def _group(browser, index: int):
    return browser.find_element(By.CSS_SELECTOR, f'#groups-section tr[data-group="{index}"]')


def _cells(row) -> list[str]:
    return [td.text for td in row.find_elements(By.TAG_NAME, "td")]


def test_run_page_shows_each_group_with_rewards_advantages_and_fate(browser, site, shots):
    run_id = site["ids"]["live_train"]
    open_page(browser, site, f"/runs/{run_id}")
    steps = [t.get_attribute("data-step") for t in browser.find_elements(By.CSS_SELECTOR, "#groups-section table.groups")]
    assert steps == ["0", "1", "2", "3"]
    expected = {  # group: (rewards, status label, reason)
        0: ("1011", "trained", ""), 2: ("1111", "set aside", "no advantage (dynamic sampling)"),
        5: ("0110", "dropped as stale", "stale: served by version 0, policy is 3"),
        6: ("1×××", "rejected", "1/4 usable episodes"), 9: ("····", "sampling", ""), 10: ("·10×", "sampling", ""),
        11: ("0110", "accepted, waiting for a step", ""),
    }
    for index, (rewards, label, reason) in expected.items():
        _index, _instance, shown_rewards, _advantages, status, samples = _cells(_group(browser, index))
        assert shown_rewards == rewards and status.startswith(label) and reason in status, index
        links = _group(browser, index).find_elements(By.CSS_SELECTOR, "td.samples a")
        assert len(links) == 4 and all("/episodes/" in a.get_attribute("href") for a in links)
    # advantages as the trainer computes them, times the staleness weight (group 4: 0.5)
    for index, rewards, weight in ((0, [1, 0, 1, 1], 1.0), (4, [1, 0, 0, 0], 0.5)):
        shown = [float(v) for v in _cells(_group(browser, index))[3].split("(")[0].split()]
        assert shown == pytest.approx([round(a * weight, 2) for a in group_advantages(rewards)], abs=0.006)
    assert _cells(_group(browser, 2))[3] == "+0.00 +0.00 +0.00 +0.00"  # set aside: no signal
    assert _cells(_group(browser, 5))[3] == "- - - -"  # dropped: never trained
    heads = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "#groups-section h3.step-head")]
    assert heads == ["step 0 completed", "step 1 completed", "step 2 training", "step 3"]
    browser.execute_script("document.getElementById('groups-section').scrollIntoView()")
    browser.save_screenshot(str(shots / "run-live-groups.png"))
    console_clean(browser)


def test_eval_groups_show_rewards_without_advantages(browser, site):
    open_page(browser, site, f"/runs/{site['ids']['eval_trained']}")
    row = _group(browser, 0)
    assert _cells(row)[2] == "1011" and _cells(row)[3].startswith("done")
    assert not browser.find_elements(By.CSS_SELECTOR, "#groups-section td.advantages")
    console_clean(browser)


@pytest.mark.parametrize("label, trained, why", [
    ("trained_live_episode", True, None),
    ("filtered_episode", False, "the group was set aside: all 4 usable rewards are 1"),
    ("stale_episode", False, "the group was dropped as stale: stale: served by version 0"),
    ("training_episode", False, "step 2 is training"),
    ("eval_episode", False, "eval runs are not trained"),
])
def test_episode_page_shows_its_group_and_never_claims_untrained_sequences_were_trained(
        browser, site, shots, label, trained, why):
    if label == "eval_episode":
        with session_scope() as s:
            episode_id = s.query(Episode.id).filter_by(run_id=site["ids"]["eval_base"]).first()[0]
    else:
        episode_id = site["ids"][label]
    open_page(browser, site, f"/episodes/{episode_id}")
    head = text(browser, "#tokens-head")
    assert (head == "Trained sequences") == trained
    assert "Trained sequences" not in browser.page_source or trained
    if why:
        assert why in text(browser, "#not-trained")
    siblings = rows(browser, "#siblings")
    assert len(siblings) == 4
    assert [r for r in siblings if "this one" in r.text][0].get_attribute("data-episode") == str(episode_id)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#siblings a")) == 3
    if label == "filtered_episode":
        assert "1111" in text(browser, "#group-status") and "set aside" in text(browser, "#group-status")
        assert browser.find_elements(By.CSS_SELECTOR, "#tokens details.sequence")  # sequences were built, not trained
        browser.save_screenshot(str(shots / "episode-set-aside.png"))
    console_clean(browser)


pytestmark = pytest.mark.timeout(300)
