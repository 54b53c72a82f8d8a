"""Every dashboard page in headless Chromium against the real API (gunicorn) with a seeded run.

Each test asserts what the page shows and fails on any SEVERE browser console entry (a
JavaScript error, a failed resource load).  Waits are explicit (`WebDriverWait`), never sleeps.
"""
from __future__ import annotations

import datetime as dt

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select
from sqlalchemy import select

from app.db import session_scope
from api.dashboard.pages import console_clean, wait_until
from app.tables import Completion, Episode, Run, Trajectory


def _open(browser, site, path: str):
    browser.get(site["url"] + path)
    wait_until(browser, lambda d: d.execute_script("return document.readyState") == "complete")


def _shot(browser, path, element_id: str | None = None) -> None:
    """Screenshot of the viewport, scrolled to `element_id` when given."""
    if element_id:
        browser.execute_script("document.getElementById(arguments[0]).scrollIntoView()", element_id)
    browser.save_screenshot(str(path))


def _rows(browser, table_id: str) -> list:
    return browser.find_elements(By.CSS_SELECTOR, f"#{table_id} tbody tr")


def test_runs_page_lists_runs_and_filters(browser, site, shots):
    _open(browser, site, "/")
    ids = site["ids"]
    rows = _rows(browser, "runs")
    with session_scope() as s:
        assert len(rows) == s.query(Run).count()  # every seeded run, in every state
    train = browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{ids["train"]}"]').text
    # 11 graded episodes, 7 resolved; 3/3 steps
    assert "completed" in train and "train" in train and "mini-swe-agent" in train and "smollm2" in train
    assert "0.636" in train and "64%" in train and "12/12 episodes, 3/3 steps" in train
    trained_eval = browser.find_element(By.CSS_SELECTOR, f'tr[data-run="{ids["eval_trained"]}"]').text
    assert "3/3" in trained_eval and f"run:{ids['train']}" in trained_eval  # solved instances: every instance resolved by some sample
    browser.save_screenshot(str(shots / "runs.png"))
    Select(browser.find_element(By.NAME, "kind")).select_by_value("eval")
    browser.find_element(By.CSS_SELECTOR, "#run-filters button").click()
    wait_until(browser, lambda d: "kind=eval" in d.current_url)
    shown = {r.get_attribute("data-run") for r in _rows(browser, "runs")}
    # Exactly the eval runs in the database: the seeded ones, and any another test of this module
    # submitted before this one (tests run in any order), and no run of another kind.
    with session_scope() as s:
        evals = {str(run_id) for run_id in s.scalars(select(Run.id).where(Run.kind == "eval"))}
    assert {str(ids[k]) for k in ("eval_base", "eval_trained", "queued_eval", "cancelling_eval")} <= evals
    assert shown == evals
    console_clean(browser)


def test_runs_page_shows_two_lora_runs_live_on_one_engine(browser, site, shots):
    """The Engines table: both LoRA runs under the one engine address every seeded run uses, each
    with its adapter, version and rollouts in flight of its fair share (share 3 gets more than
    share 1); full fine-tunes and evals on the same engine say what they put there; the engine's
    row says how many harness calls the gateway held during its weight reloads."""
    from app.config import get_settings
    from app.control.shares import allowances

    _open(browser, site, "/")
    url = get_settings().engine_urls[0]
    shown = {r.get_attribute("data-run"): r for r in _rows(browser, "engines")}
    assert {r.get_attribute("data-engine") for r in shown.values()} == {url}
    ids = site["ids"]
    with session_scope() as s:
        every = allowances(s)
    allowed = {label: every[ids[label]] for label in ("lora_a", "lora_b")}
    assert allowed["lora_b"] > allowed["lora_a"] >= 1
    for label, digest, running in (("lora_a", "3f9a0c1d2e4b", 3), ("lora_b", "a41c77e09b25", 4)):
        cells = [td.text for td in shown[str(ids[label])].find_elements(By.TAG_NAME, "td")]
        cells = cells[-8:]  # the engine cell spans the rows: only the first row has it
        assert cells[2:] == ["train", "LoRA adapter", f"run-{ids[label]}@{digest}", "1",
                             f"{running} of {allowed[label]}", "3.0" if label == "lora_b" else "1.0"], cells
    full = [td.text for td in shown[str(ids["live_train"])].find_elements(By.TAG_NAME, "td")][-8:]
    assert full[3:5] == ["full weights", "-"]
    queued = [td.text for td in shown[str(ids["queued_train"])].find_elements(By.TAG_NAME, "td")][-8:]
    assert queued[1] == "queued" and queued[6] == "0"  # not running: no share asked of it yet
    assert str(ids["train"]) not in shown  # a finished run is on no engine
    held = browser.find_element(By.CSS_SELECTOR, "#engines td.held").text
    assert held == "3 calls, 4.5 s; 1 now", held  # the gateway's reload-hold counters of that engine
    _shot(browser, shots / "runs-engines.png", "engines")
    console_clean(browser)


def test_run_page_shows_config_curves_and_episodes(browser, site, shots):
    run_id = site["ids"]["train"]
    _open(browser, site, f"/runs/{run_id}")
    assert "Run #%d" % run_id in browser.find_element(By.TAG_NAME, "h1").text
    captions = [f.get_attribute("data-title") for f in browser.find_elements(By.CSS_SELECTOR, "figure.chart")]
    for title in ("reward (mean ± std)", "resolved rate", "loss", "KL", "clip fraction",
                  "trainer vs rollout logprob gap (nats)", "tokens trained", "prefix merging",
                  "trainer busy / rollout slots", "queue waits (s)", "staleness (policy versions)"):
        assert title in captions
    # uPlot drew one canvas per chart
    wait_until(
        browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "figure.chart canvas")) == len(captions))
    assert not browser.find_elements(By.CSS_SELECTOR, ".not-computed")  # this run's KL was computed (kl_coef 0.001)
    legend = browser.find_element(By.CSS_SELECTOR, "#chart-0 .u-legend").text
    assert "mean" in legend and "mean + std" in legend
    assert len(_rows(browser, "episodes")) == 12
    assert browser.find_element(By.ID, "stat-steps").text == "3/3"
    browser.find_element(By.CSS_SELECTOR, "#config summary").click()
    assert '"harness": "mini-swe-agent"' in browser.find_element(By.CSS_SELECTOR, "#config pre").text
    _shot(browser, shots / "run.png")
    _shot(browser, shots / "run-episodes.png", "episodes-section")
    Select(browser.find_element(By.CSS_SELECTOR, "#episode-filters select[name=status]")).select_by_value("failed")
    browser.find_element(By.CSS_SELECTOR, "#episode-filters button").click()
    wait_until(browser, lambda d: "status=failed" in d.current_url)
    rows = _rows(browser, "episodes")
    assert len(rows) == 1 and "No module named 'yaml'" in rows[0].text
    assert "Cancel run" not in browser.page_source  # finished runs cannot be cancelled
    console_clean(browser)


def test_episode_page_shows_grading_patch_log_calls_and_tokens(browser, site, shots):
    episode_id = site["ids"]["merged_episode"]
    _open(browser, site, f"/episodes/{episode_id}")
    tests = [r.text for r in _rows(browser, "tests")]
    assert any("FAIL_TO_PASS" in t and "test_fixed" in t and "failed" in t for t in tests)  # step 0 sample 0: unresolved
    assert sum("PASS_TO_PASS" in t and "passed" in t for t in tests) == 2
    log = browser.find_element(By.CSS_SELECTOR, "#logs pre.log-tail").text
    assert "Submitted: calc.py fixed" in log and "step 299" in log and "step 50:" not in log  # the tail only
    calls = browser.find_elements(By.CSS_SELECTOR, "#calls article.call")
    assert len(calls) == 3
    assert "cat calc.py" in calls[0].text and "return a - b" in calls[1].text  # the tool result opens call 1
    with session_scope() as s:
        trajs = s.query(Trajectory).filter_by(episode_id=episode_id).all()
        sampled = sum(sum(t.loss_mask) for t in trajs)
    assert len(trajs) == 1  # three calls merged into one sequence
    tokens = browser.find_elements(By.CSS_SELECTOR, "#tokens .tokens .tok")
    assert len(tokens) == sampled
    assert "logprob" in tokens[0].get_attribute("title")
    assert browser.find_elements(By.CSS_SELECTOR, "#tokens .tokens .ctx")
    text = browser.find_element(By.CSS_SELECTOR, "#tokens .tokens").text
    assert "You are a helpful assistant" in text and "cat calc.py" in text  # decoded by the run's tokenizer
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tokens .call-mark")) == 3
    assert "3 completions → 1 sequences (2 merged, 0 cut" in browser.find_element(By.ID, "merge-summary").text
    _shot(browser, shots / "episode.png")
    _shot(browser, shots / "episode-calls.png", "calls")
    _shot(browser, shots / "episode-tokens.png", "tokens")
    console_clean(browser)


def test_episode_page_shows_cut_reasons_and_diff(browser, site, shots):
    episode_id = site["ids"]["cut_episode"]
    _open(browser, site, f"/episodes/{episode_id}")
    cuts = _rows(browser, "cuts")
    assert len(cuts) == 1 and "context_diverged" in cuts[0].text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tokens details.sequence")) == 2
    assert "history rewritten" in browser.find_elements(By.CSS_SELECTOR, "#calls article.call")[2].text
    assert browser.find_element(By.CSS_SELECTOR, "#diff .d-add").text == "+    return b - a"  # an unresolved try
    browser.save_screenshot(str(shots / "episode-cut.png"))
    console_clean(browser)


def test_compare_page_shows_pass_at_k_with_intervals(browser, site, shots):
    ids = site["ids"]
    _open(browser, site, "/compare")
    Select(browser.find_element(By.NAME, "a")).select_by_value(str(ids["eval_base"]))
    Select(browser.find_element(By.NAME, "b")).select_by_value(str(ids["eval_trained"]))
    browser.find_element(By.CSS_SELECTOR, "#compare-form button").click()
    # the seeded "after" eval samples the train run's policy on the instances it trained on
    wait_until(browser, EC.presence_of_element_located((By.ID, "compare-refused")))
    assert "instance(s) it trained on" in browser.find_element(By.ID, "compare-refused").text
    browser.find_element(By.ID, "compare-force").click()
    wait_until(browser, EC.presence_of_element_located((By.ID, "compare")))
    assert len(_rows(browser, "compare")) == 3
    calc = browser.find_element(By.CSS_SELECTOR, 'tr[data-instance="synthetic__calc-add"]').text
    assert "1/4" in calc and "3/4" in calc and "0.25 [0.05, 0.70]" in calc
    overall = browser.find_element(By.ID, "compare-overall").text
    assert "2/12" in overall and "7/12" in overall  # resolved samples before and after
    assert "0.67 [0.21, 0.94]" in overall and "1.00 [0.44, 1.00]" in overall  # pass@4 over instances
    browser.save_screenshot(str(shots / "compare.png"))
    console_clean(browser)


def test_submit_form_shows_every_api_error_inline_then_creates_the_run(browser, site, shots):
    _open(browser, site, "/submit")
    form = browser.find_element(By.ID, "submit-form")
    assert form.find_element(By.CSS_SELECTOR, '[data-path="training.learning_rate"]')  # nested options generated
    form.find_element(By.CSS_SELECTOR, '[data-path="group_size"]').send_keys("four")
    form.find_element(By.CSS_SELECTOR, '[data-path="timeouts.agent_s"]').send_keys("0")
    form.find_element(By.ID, "submit-run").click()
    slot = '[data-error-for="{}"]'
    wait_until(
        browser, lambda d: d.find_element(By.CSS_SELECTOR, slot.format("group_size")).text)
    assert "valid integer" in browser.find_element(By.CSS_SELECTOR, slot.format("group_size")).text
    assert "greater than or equal to 1" in browser.find_element(By.CSS_SELECTOR, slot.format("timeouts.agent_s")).text
    assert "invalid run config" in browser.find_element(By.ID, "submit-errors").text
    browser.save_screenshot(str(shots / "submit.png"))
    for path, value in (("group_size", "2"), ("timeouts.agent_s", "60"), ("kind", '"eval"'),
                        ("simulate.episode_median_s", "0.1")):
        el = form.find_element(By.CSS_SELECTOR, f'[data-path="{path}"]')
        if el.tag_name == "select":
            Select(el).select_by_value(value)
        else:
            el.clear()
            el.send_keys(value)
    form.find_element(By.ID, "submit-run").click()
    wait_until(browser, EC.presence_of_element_located((By.ID, "run-page")))
    run_id = int(browser.find_element(By.ID, "run-page").get_attribute("data-run-id"))
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.kind == "eval" and run.config["group_size"] == 2 and run.config["simulate"]["episode_median_s"] == 0.1
    # the two rejected posts are the only console entries allowed
    console_clean(browser, allowed=("/api/runs - Failed to load resource: the server responded with a status of 400",))


def test_running_run_refreshes_live_and_cancels(browser, site, shots):
    run_id = site["ids"]["running"]
    _open(browser, site, f"/runs/{run_id}")
    assert browser.find_element(By.ID, "live-indicator")
    assert browser.find_element(By.ID, "stat-reward").text == "-"
    with session_scope() as s:
        ep = s.query(Episode).filter_by(run_id=run_id, sample_index=0).one()
        ep.status, ep.reward, ep.resolved = "completed", 1.0, True
        ep.rollout_finished_at = ep.finished_at = dt.datetime.now(dt.timezone.utc)
    wait_until(browser, lambda d: d.find_element(By.ID, "stat-reward").text == "1.000")
    assert "completed 1" in browser.find_element(By.ID, "run-stats").text
    browser.save_screenshot(str(shots / "run-live.png"))
    browser.find_element(By.ID, "cancel-run").click()
    wait_until(browser, EC.alert_is_present()).accept()
    wait_until(
        browser, lambda d: "cancelling" in d.find_element(By.CSS_SELECTOR, "#run-head h1").text)
    with session_scope() as s:
        assert s.get(Run, run_id).status == "cancelling"
    console_clean(browser)


def test_unknown_pages_answer_an_html_404_and_the_api_keeps_json(browser, site):
    _open(browser, site, "/runs/99999")
    assert "run 99999 not found" in browser.find_element(By.ID, "error-message").text
    console_clean(browser, allowed=("status of 404",))
    import httpx

    from support import AUTH

    resp = httpx.get(site["url"] + "/api/runs/99999", headers=AUTH)
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "run 99999 not found"


def test_tokens_shown_match_the_stored_sequence(site):
    """The token view's sampled pieces are exactly the trajectory's mask-1 tokens, in order."""
    from app.api.dashboard.episode import token_view

    with session_scope() as s:
        traj = s.query(Trajectory).filter_by(episode_id=site["ids"]["merged_episode"]).one()
        pieces = token_view(traj, None)
        sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
        assert [p["id"] for p in pieces if p["sampled"]] == sampled
        assert sum(p["n"] for p in pieces if not p["sampled"]) == len(traj.token_ids) - len(sampled)
        assert s.query(Completion).join(Episode).filter(Episode.id == traj.episode_id).count() == 3


pytestmark = pytest.mark.timeout(300)


def test_episode_page_opens_the_log_at_its_end_and_the_tokens_at_the_first_sampled_one(browser, site):
    _open(browser, site, f"/episodes/{site['ids']['merged_episode']}")
    log = browser.execute_script("const p = document.querySelector('#logs pre.log-tail');"
                                 "return [p.scrollTop, p.clientHeight, p.scrollHeight];")
    assert log[2] > log[1] and log[0] + log[1] >= log[2] - 2, log  # a long log, shown at its last line
    box = browser.execute_script("""
        const box = document.querySelector('#tokens .tokens'), first = box.querySelector('.tok');
        return [box.scrollTop, box.clientHeight, first.offsetTop, box.scrollHeight];""")
    scroll, height, first, total = box
    assert total > height and first > height, box  # the prompt's grey context fills more than the view
    assert scroll <= first < scroll + height, box  # the first sampled token is in view
    console_clean(browser)


def test_episode_page_says_how_the_harness_ended_once(browser, site):
    _open(browser, site, f"/episodes/{site['ids']['failed_episode']}")
    head = browser.find_element(By.ID, "episode-head").text
    assert "harness ended: exit 1" in head and "exit exit" not in head


def _luminance(rgb: str) -> float:
    """Relative luminance of a CSS `rgb(...)`/`rgba(...)` colour (WCAG 2.x definition)."""
    r, g, b = (int(float(x)) / 255 for x in rgb[rgb.index("(") + 1:rgb.index(")")].split(",")[:3])
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def test_sign_out_is_readable_on_the_top_bar(browser, site):
    _open(browser, site, "/")
    fg, bg = browser.execute_script("""
        const b = document.querySelector('header.top form.logout button');
        return [getComputedStyle(b).color, getComputedStyle(document.querySelector('header.top')).backgroundColor];""")
    lighter, darker = sorted((_luminance(fg), _luminance(bg)), reverse=True)
    assert (lighter + 0.05) / (darker + 0.05) >= 4.5, (fg, bg)  # WCAG AA contrast for normal text
