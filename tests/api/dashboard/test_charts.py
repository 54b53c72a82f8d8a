"""The run page's charts in headless Chromium: values on hover, "not computed" instead of a
measured 0, [0, 1] axes for rates and rewards, a reset after zoom, and every metric the trainer records."""
from __future__ import annotations

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from api.dashboard.pages import chart_id, console_clean, drag_zoom, open_page, reset_zoom, text, wait_until, x_scale


def _drawn(browser) -> None:
    wait_until(browser, lambda d: d.execute_script("return Object.keys(CHARTS).length") > 0)


def test_recorded_metrics_are_charted_and_unrecorded_ones_named(browser, site):
    open_page(browser, site, f"/runs/{site['ids']['train']}")
    captions = [f.get_attribute("data-title") for f in browser.find_elements(By.CSS_SELECTOR, "figure.chart")]
    for title in ("grad norm (before clipping)", "step time (s)", "advantages", "TIS truncated fraction",
                  "TIS weight / PPO ratio (mean)", "response length (sampled tokens per episode)",
                  "groups with no signal (fraction)"):
        assert title in captions
    assert "entropy" in text(browser, "#missing-charts")  # the trainer does not record it
    _drawn(browser)
    legend = text(browser, f"#{chart_id(browser, 'advantages')} .u-legend")
    assert all(label in legend for label in ("mean", "std", "min", "max"))
    console_clean(browser)


def test_rates_and_rewards_sit_on_a_unit_axis(browser, site):
    open_page(browser, site, f"/runs/{site['ids']['train']}")
    _drawn(browser)
    for title in ("reward (mean ± std)", "resolved rate", "clip fraction", "trainer busy / rollout slots"):
        low, high = browser.execute_script("const y = CHARTS[arguments[0]].plot.scales.y; return [y.min, y.max];",
                                           chart_id(browser, title))
        assert (low, high) == (0, 1), title
    loss = browser.execute_script("return CHARTS[arguments[0]].plot.scales.y.max;", chart_id(browser, "loss"))
    assert loss < 0.1  # other metrics fit their own values
    console_clean(browser)


def test_hover_shows_values_and_not_computed(browser, site, shots):
    open_page(browser, site, f"/runs/{site['ids']['live_train']}")
    _drawn(browser)
    kl = browser.find_element(By.CSS_SELECTOR, 'figure.chart[data-title="KL"]')
    assert kl.text.endswith("not computed: kl_coef is 0") and not kl.find_elements(By.TAG_NAME, "canvas")
    loss_id = chart_id(browser, "loss")
    over = browser.find_element(By.CSS_SELECTOR, f"#{loss_id} .u-over")
    width = over.size["width"]
    values = []
    for fraction in (0.02, 0.98):  # steps 0 and 1 sit at the two ends of the x axis
        ActionChains(browser).move_to_element_with_offset(over, int(width * (fraction - 0.5)), 0).perform()
        wait_until(
            browser, lambda d: d.find_element(By.CSS_SELECTOR, f"#{loss_id} .u-legend .u-series:nth-child(2) .u-value").text)
        values.append(text(browser, f"#{loss_id} .u-legend .u-series:nth-child(2) .u-value"))
    # step 0's measured loss; step 1 made no optimizer update: its recorded 0.0 is shown as not computed
    assert values[0] not in ("", "-", "not computed") and float(values[0]) > 0
    assert values[1] == "not computed"
    step_values = browser.execute_script("return CHARTS[arguments[0]].plot.data[1];", loss_id)
    assert step_values[1] is None
    reward_id = chart_id(browser, "reward (mean ± std)")
    reward = browser.find_element(By.CSS_SELECTOR, f"#{reward_id} .u-over")
    ActionChains(browser).move_to_element_with_offset(reward, int(reward.size["width"] * 0.48), 0).perform()
    mean = f"#{reward_id} .u-legend .u-series:nth-child(2) .u-value"
    wait_until(browser, lambda d: text(d, mean) not in ("", "-"))
    assert 0 <= float(text(browser, mean)) <= 1
    browser.save_screenshot(str(shots / "run-live-charts.png"))  # the cursor on step 1 of the reward chart
    console_clean(browser)


def test_drag_zoom_then_reset_shows_every_step(browser, site):
    open_page(browser, site, f"/runs/{site['ids']['train']}")
    _drawn(browser)
    chart = chart_id(browser, "loss")
    drag_zoom(browser, chart, -0.45, 0.5)
    wait_until(browser, lambda d: x_scale(d, chart)[1] < 2)
    reset_zoom(browser, chart)
    assert x_scale(browser, chart) == [0, 2]
    console_clean(browser)


pytestmark = pytest.mark.timeout(300)
