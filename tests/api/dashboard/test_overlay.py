"""Several runs' per-step curves on one page (`/runs?compare=…`), reached from the runs list.

Headless Chromium against the real API (gunicorn) over the seeded runs (`support.dashboard_seed`).
"""
from __future__ import annotations

import html

import httpx
import pytest
from selenium.webdriver.common.by import By

from api.dashboard.pages import console_clean, open_page, rows, text, wait_until
from support import AUTH


def test_runs_overlaid_on_one_page_named_by_kind_harness_model_and_task_set(browser, site, shots):
    ids = site["ids"]
    a, b = ids["train"], ids["live_train"]
    open_page(browser, site, f"/runs?compare={a},{b}")
    legend = {r.get_attribute("data-run"): r.text for r in rows(browser, "#overlay-runs")}
    assert list(legend) == [str(a), str(b)]
    assert f"#{a} train · mini-swe-agent · smollm2 · synthetic" in legend[str(a)]
    assert "3" in legend[str(a)].split()[-1] and legend[str(b)].split()[-1] == "2"  # completed steps
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-0 canvas"))
    reward = browser.find_element(By.CSS_SELECTOR, "#chart-0 .u-legend").text
    assert f"#{a} mean" in reward and f"#{b} mean" in reward
    # hover: every run's value at the pointed step (step 0: both runs have it)
    values = browser.execute_script("""
        const u = CHARTS["chart-0"].plot; u.setCursor({left: u.valToPos(0, "x"), top: 10});
        return [...document.querySelectorAll("#chart-0 .u-legend .u-series td.u-value")].map((td) => td.textContent);""")
    assert values[0] == "0" and all(v not in ("-", "") for v in values[1:]), values
    # a run without step 2 has no value there: "not computed" in its column, never a 0
    values = browser.execute_script("""
        const u = CHARTS["chart-0"].plot; u.setCursor({left: u.valToPos(2, "x"), top: 10});
        return [...document.querySelectorAll("#chart-0 .u-legend .u-series td.u-value")].map((td) => td.textContent);""")
    assert values[0] == "2" and values[1] != "not computed" and values[2] == "not computed", values
    # the same run keeps its colour on every chart
    strokes = browser.execute_script("""
        return Object.values(CHARTS).map((c) => c.plot.series.slice(1).map((s) => s._stroke || s.stroke()));""")
    assert all(s == strokes[0] for s in strokes if len(s) == 2), strokes
    swatches = browser.execute_script(
        "return [...document.querySelectorAll('#overlay-runs .swatch')].map((el) => el.style.background);")
    assert len(set(swatches)) == 2 and all(swatches)
    assert browser.execute_script("return CHARTS['chart-0'].plot.scales.y.min") == 0  # rewards keep [0, 1]
    # both runs' advantage mean is 0 at every step: a flat line on an axis around 0, not on 0..100
    adv = next(k for k, c in browser.execute_script("return Object.fromEntries(Object.entries(CHARTS).map("
                                                    "([k, c]) => [k, c.plot.root.closest('figure').dataset.title]))").items()
               if c == "advantages")
    low, high = browser.execute_script(f"const s = CHARTS['{adv}'].plot.scales.y; return [s.min, s.max];")
    assert -1.5 <= low < 0 < high <= 1.5, (low, high)
    browser.save_screenshot(str(shots / "overlay.png"))
    console_clean(browser)


def test_the_runs_list_leads_to_the_overlay(browser, site):
    ids = site["ids"]
    open_page(browser, site, "/")
    for run_id in (ids["train"], ids["failed_train"]):
        browser.find_element(By.CSS_SELECTOR, f'#runs input[name=compare][value="{run_id}"]').click()
    browser.find_element(By.ID, "overlay-button").click()
    wait_until(browser, lambda d: "/runs?compare=" in d.current_url)
    assert [r.get_attribute("data-run") for r in rows(browser, "#overlay-runs")] == [str(ids["train"]),
                                                                                    str(ids["failed_train"])]
    console_clean(browser)


def test_an_eval_run_in_the_overlay_is_named_as_having_no_steps(browser, site):
    ids = site["ids"]
    open_page(browser, site, f"/runs?compare={ids['train']},{ids['eval_base']},99999")
    note = text(browser, "#overlay-no-steps")
    assert f"#{ids['eval_base']} (eval, completed)" in note and "Compare" in note
    assert text(browser, "#overlay-missing") == "not found: run 99999"
    console_clean(browser)


@pytest.mark.parametrize("query, status, words", [
    ("compare=abc", 400, "'abc' is not a run id"), ("compare=,", 400, "give run ids"),
    ("compare=" + ",".join(str(i) for i in range(1, 11)), 400, "at most 8 runs"),
    ("compare=99998,99999", 404, "run 99998, 99999 not found"),
])
def test_bad_overlay_requests_are_named(site, query, status, words):
    resp = httpx.get(f"{site['url']}/runs?{query}", headers=AUTH, timeout=30)
    assert resp.status_code == status and words in html.unescape(resp.text)


def test_runs_without_compare_is_the_runs_list(site):
    resp = httpx.get(f"{site['url']}/runs", headers=AUTH, timeout=30)
    assert resp.status_code == 302 and resp.headers["location"] == "/"
