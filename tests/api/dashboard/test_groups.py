"""GRPO groups and why episodes did not resolve, on the run page, the episode page and in the API,
in headless Chromium over the seeded runs."""
from __future__ import annotations

import httpx
import pytest
from selenium.webdriver.common.by import By

from api.dashboard.pages import console_clean, open_page, rows, text
from app.advantages import group_advantages
from app.db import session_scope
from app.tables import Episode
from support import AUTH


@pytest.fixture(scope="module")
def client(site):
    """The site's REST API, with the API token."""
    with httpx.Client(base_url=site["url"], headers=AUTH, timeout=30) as c:
        yield c


def _group(browser, index: int):
    return browser.find_element(By.CSS_SELECTOR, f'#groups-section tr[data-group="{index}"]')


def _cells(row) -> list[str]:
    return [td.text for td in row.find_elements(By.TAG_NAME, "td")]


def test_run_page_shows_each_group_with_rewards_advantages_and_fate(browser, site, shots):
    run_id = site["ids"]["live_train"]
    open_page(browser, site, f"/runs/{run_id}")
    steps = [t.get_attribute("data-step") for t in browser.find_elements(By.CSS_SELECTOR, "#groups-section table.groups")]
    assert steps == ["0", "1", "2", "3"]
    expected = {  # group: (rewards, state in words)
        0: ("1011", "trained in step 0"), 3: ("0011", "trained in step 1"), 7: ("1100", "training in step 2"),
        2: ("1111", "set aside: all 4 usable rewards are 1: no advantage (dynamic sampling)"),
        5: ("0110", "set aside: stale: served by version 0, policy is 3"),
        6: ("1×××", "set aside: 1/4 usable episodes"), 9: ("····", "waiting for step 3"),
        10: ("·10×", "waiting for step 3"), 11: ("0110", "waiting for step 3"),
    }
    for index, (rewards, label) in expected.items():
        _index, _instance, shown_rewards, _advantages, status, samples = _cells(_group(browser, index))
        assert (shown_rewards, status) == (rewards, label), index
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
    ("filtered_episode", False, "the group is set aside: all 4 usable rewards are 1"),
    ("stale_episode", False, "the group is set aside: stale: served by version 0"),
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


# (seeded run, group) -> the words for its state: a step on the gpu queue, a failed step, a step
# that took a group sampled for a later step, a group no step will take
STATE_CASES = [("pending_train", 0, "waiting", "waiting for step 0"),
               ("failed_train", 0, "trained", "trained in step 0"),
               ("failed_train", 1, "not_trained", "not trained: step 1 failed: CUDA out of memory (tried to allocate 2.1 GiB)"),
               ("early_train", 1, "trained", "trained in step 0"), ("early_train", 2, "training", "training in step 1"),
               ("early_train", 0, "not_trained", "not trained: all 2 steps have their groups")]


def test_every_group_state_reads_the_same_on_the_run_page_the_episode_page_and_the_api(browser, site, client):
    for label, index, state, words in STATE_CASES:
        run_id = site["ids"][label]
        open_page(browser, site, f"/runs/{run_id}")
        row = _group(browser, index)
        assert row.get_attribute("data-state") == state and _cells(row)[4] == words, (label, index)
        with session_scope() as s:
            episode_id = s.query(Episode.id).filter_by(run_id=run_id, group_index=index).order_by(Episode.id).first()[0]
        open_page(browser, site, f"/episodes/{episode_id}")
        assert text(browser, "#episode-step") == words
        assert words in text(browser, "#group-status")
        body = client.get(f"/api/episodes/{episode_id}").json()
        assert body["group"]["label"] == words and body["group"]["state"] == state
        listed = client.get(f"/api/runs/{run_id}/episodes").json()["episodes"]
        assert {e["group"]["label"] for e in listed if e["group_index"] == index} == {words}
        console_clean(browser)


def test_an_episode_s_step_is_the_step_that_trained_it(browser, site, client):
    """Sampled for step 1, taken by step 0: its header, its group and the API all say step 0."""
    episode_id = site["ids"]["early_episode"]
    with session_scope() as s:
        assert s.get(Episode, episode_id).step == 1
    open_page(browser, site, f"/episodes/{episode_id}")
    assert text(browser, "#episode-step") == "trained in step 0"
    assert "step 1" not in text(browser, "#episode-head")
    assert client.get(f"/api/episodes/{episode_id}").json()["step"] == 0
    open_page(browser, site, f"/runs/{site['ids']['early_train']}")
    cell = browser.find_element(By.CSS_SELECTOR, f'#episodes tr[data-episode="{episode_id}"] td:nth-child(3)')
    assert cell.text == "0" and cell.get_attribute("title") == "trained in step 0"
    console_clean(browser)


def test_a_run_that_never_started_has_no_groups(browser, site, client):
    run_id = site["ids"]["queued_train"]
    open_page(browser, site, f"/runs/{run_id}")
    assert not browser.find_elements(By.CSS_SELECTOR, "#groups-section")
    assert client.get(f"/api/runs/{run_id}/episodes").json() == {"episodes": []}
    console_clean(browser)


@pytest.mark.parametrize("label", ["live_train", "eval_base", "train"])
def test_every_episode_that_ended_unresolved_shows_why_on_both_pages_and_in_the_api(browser, site, client, label):
    run_id = site["ids"][label]
    listed = {e["id"]: e for e in client.get(f"/api/runs/{run_id}/episodes").json()["episodes"]}
    ended = {i: e for i, e in listed.items() if e["status"] in ("failed", "cancelled")
             or (e["status"] == "completed" and not e["resolved"])}
    assert ended and all(e["failure_reason"] is None for i, e in listed.items() if i not in ended)
    open_page(browser, site, f"/runs/{run_id}")
    for episode_id, e in ended.items():
        reason = e["failure_reason"]
        assert reason["text"], episode_id
        cell = browser.find_element(By.CSS_SELECTOR, f'#episodes tr[data-episode="{episode_id}"] td.reason')
        assert (cell.text, cell.get_attribute("data-kind")) == (reason["text"], reason["kind"])
    kinds = {e["failure_reason"]["kind"] for e in ended.values()}
    assert kinds == {"live_train": {"fail_to_pass", "timeout", "cancelled"}, "eval_base": {"no_patch"},
                     "train": {"fail_to_pass", "error"}}[label]
    episode_id, e = next(iter(ended.items()))
    open_page(browser, site, f"/episodes/{episode_id}")
    assert text(browser, "#failure-reason") == "not resolved: " + e["failure_reason"]["text"]
    console_clean(browser)


pytestmark = pytest.mark.timeout(300)
