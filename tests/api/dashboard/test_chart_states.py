"""Every chart of the run page in every state a run passes through (headless Chromium).

For each seeded state (0, 1, 2, 50 steps; all-negative, mixed-sign and constant series; NaN and
None; metrics never computed) the page must draw without a console error, every tick label of every
axis must be the formatted tick value with its sign and lie inside its axis (a 56 px axis cut the
"-" of -0.0077), a single step must not be spread over 0..100, and hovering a point must show the
stored number.  Also: smoothing (kept in localStorage, raw line kept), a CSV per chart, and the
run's metrics from GET /api/runs/<id>/metrics.
"""
from __future__ import annotations

import csv
import io
import math

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from api.dashboard.pages import chart_id, console_clean, drag_zoom, open_page, reset_zoom, text, wait_until, x_scale
from support import AUTH
from support.chart_seed import seed_chart_states, step_metrics

pytestmark = pytest.mark.timeout(300)

# Per drawn chart: its y and x tick labels, tick values, the widest label and the room the axis leaves it.
AXES_JS = """
const out = {};
for (const [id, c] of Object.entries(CHARTS)) {
  const u = c.plot, ctx = document.createElement("canvas").getContext("2d");
  out[id] = u.axes.map((a) => {
    ctx.font = a.font[0];
    const widths = (a._values || []).map((v) => ctx.measureText(String(v)).width / devicePixelRatio);
    return {values: (a._values || []).map(String), splits: a._splits || [], size: a._size,
            room: a._size - (a.ticks.show ? a.ticks.size : 0) - a.gap, widest: Math.max(0, ...widths)};
  });
  out[id].push({x: [u.scales.x.min, u.scales.x.max], y: [u.scales.y.min, u.scales.y.max]});
}
return out;
"""


@pytest.fixture(scope="module")
def runs(site):
    """The chart-state runs, written into the site's database (the site fixture's settings are active)."""
    return seed_chart_states()


def _load(browser, site, run_id: int) -> None:
    open_page(browser, site, f"/runs/{run_id}")
    wait_until(browser, lambda d: d.execute_script(
        "return document.querySelectorAll('figure.chart canvas').length > 0 && Object.keys(CHARTS).length > 0"))


def _check_axes(browser, steps: list[int]) -> dict:
    """Every tick label equals its tick's value (sign included), fits inside its axis; x spans the steps."""
    axes = browser.execute_script(AXES_JS)
    assert axes, "no chart was drawn"
    for chart, (x_axis, y_axis, scales) in axes.items():
        # no y label is cut at the canvas edge (x labels are centred under their ticks: their height counts)
        assert y_axis["widest"] <= y_axis["room"], (chart, y_axis)
        for label, split in zip(y_axis["values"], y_axis["splits"]):
            assert label.startswith("-") == (float(label) < 0) == (split < 0 and float(label) != 0), (chart, label, split)
            assert math.isclose(float(label), split, rel_tol=0.01, abs_tol=1e-12), (chart, label, split)
        shown = [int(v) for v in x_axis["values"] if v]
        assert shown and all(s >= 0 for s in shown), (chart, x_axis["values"])
        low, high = scales["x"]
        if len(steps) == 1:
            assert (low, high) == (steps[0] - 1, steps[0] + 1), chart  # not 0..100
        else:
            assert (low, high) == (steps[0], steps[-1]), chart
    return axes


def _hover(browser, chart: str, step: int, series: int = 1) -> str:
    """Move the mouse onto `step` of chart `chart`; the legend value of `series` (1 = first line)."""
    left, width = browser.execute_script(
        "const u = CHARTS[arguments[0]].plot; return [u.valToPos(arguments[1], 'x'), u.over.clientWidth];",
        chart, step)
    over = browser.find_element(By.CSS_SELECTOR, f"#{chart} .u-over")
    left = min(max(round(left), 1), width - 2)  # the first and last step sit on the edges: stay inside
    ActionChains(browser).move_to_element_with_offset(over, left - width // 2, 0).perform()
    cell = f"#{chart} .u-legend .u-series:nth-child({series + 1}) .u-value"
    wait_until(browser, lambda d: text(d, cell) not in ("", "-"))
    return text(browser, cell)


def _fmt(v: float) -> str:
    """The page's value format (fmtValue in dashboard.js), written again here."""
    a = abs(v)
    if a and (a < 1e-3 or a >= 1e5):
        mantissa, exp = f"{v:.2e}".split("e")
        return f"{mantissa}e{int(exp):+d}"
    return str(int(v)) if v == int(v) else f"{v:.{4 if a < 1 else 2}f}"


@pytest.mark.parametrize("state,steps", [("one", [0]), ("two", [0, 1]), ("fifty", list(range(50))),
                                         ("nan_none", [0, 1, 2])])
def test_every_axis_reads_right(browser, site, runs, state, steps):
    browser.execute_script("window.localStorage.removeItem('turnstile.chartSmoothing')")
    _load(browser, site, runs[state])
    axes = _check_axes(browser, steps)
    n = len(steps)
    loss, grad = chart_id(browser, "loss"), chart_id(browser, "grad norm (before clipping)")
    assert all(label.startswith("-") for label in axes[loss][1]["values"])  # loss is negative throughout
    for step in steps:
        stored = step_metrics(step, n)
        if state == "nan_none" and step == 1:
            assert _hover(browser, loss, step) == "not computed"  # NaN is not drawn as a value
            assert _hover(browser, grad, step) == "not computed"  # null
            continue
        if n > 3 and step not in (0, 17, n - 1):
            continue  # 50 steps: three points are enough to prove the cursor reads the stored number
        assert _hover(browser, loss, step) == _fmt(stored["loss"]), (state, step)
        assert _hover(browser, grad, step) == _fmt(stored["grad_norm"]), (state, step)
    low, high = axes[grad][2]["y"]
    if n == 1:  # one grad norm of 0.04: drawn mid-axis, not on a 0..1 axis's 0 line
        assert low > 0 and high < 0.1
    kl = browser.find_element(By.CSS_SELECTOR, 'figure.chart[data-title="KL"]')
    assert kl.text.endswith("not computed: kl_coef is 0")
    assert "entropy" in text(browser, "#missing-charts")
    console_clean(browser)


def test_tis_ratio_chart_with_one_step(browser, site, runs):
    _load(browser, site, runs["one"])
    chart = chart_id(browser, "TIS weight / PPO ratio (mean)")
    assert browser.find_elements(By.CSS_SELECTOR, f"#{chart} canvas")
    assert _hover(browser, chart, 0, 1) == "1" and _hover(browser, chart, 0, 2) == _fmt(step_metrics(0, 1)["ratio_mean"])
    low, high = browser.execute_script("const y = CHARTS[arguments[0]].plot.scales.y; return [y.min, y.max];", chart)
    assert low < 1 < high
    console_clean(browser)


def test_no_steps_says_why(browser, site, runs):
    open_page(browser, site, f"/runs/{runs['zero']}")
    assert "No completed training steps yet (step 0 is training)" in text(browser, "#no-steps")
    assert not browser.find_elements(By.CSS_SELECTOR, "figure.chart")
    console_clean(browser)


def test_constant_and_mixed_sign_series(browser, site, runs):
    _load(browser, site, runs["fifty"])
    clip = chart_id(browser, "clip fraction")
    assert browser.execute_script("return CHARTS[arguments[0]].plot.scales.y.min", clip) == 0  # a rate: 0..1
    adv = chart_id(browser, "advantages")
    labels = browser.execute_script(AXES_JS)[adv][1]["values"]
    assert any(v.startswith("-") for v in labels) and any(not v.startswith("-") and float(v) > 0 for v in labels)
    assert _hover(browser, adv, 17) == _fmt(step_metrics(17, 50)["advantage_mean"])
    console_clean(browser)


def test_zoom_and_reset(browser, site, runs):
    for state, full in (("fifty", [0, 49]), ("two", [0, 1])):
        _load(browser, site, runs[state])
        chart = chart_id(browser, "loss")
        drag_zoom(browser, chart, -0.4, 0.4)
        wait_until(browser, lambda d: x_scale(d, chart) != full, state)
        reset_zoom(browser, chart)
        assert x_scale(browser, chart) == full
        console_clean(browser)
    _load(browser, site, runs["one"])  # one step: nothing to zoom into, the axis stays one step either side
    chart = chart_id(browser, "loss")
    drag_zoom(browser, chart, -0.3, 0.25)
    reset_zoom(browser, chart)
    assert x_scale(browser, chart) == [-1, 1]
    console_clean(browser)


def test_smoothing_is_debiased_ema_kept_per_user_with_raw_line(browser, site, runs, shots):
    _load(browser, site, runs["twelve"])
    browser.execute_script("""const s = document.getElementById('chart-smoothing');
                              s.value = '0.6'; s.dispatchEvent(new Event('input'));""")
    loss = chart_id(browser, "loss")
    raw = [step_metrics(i, 12)["loss"] for i in range(12)]
    last, expected = 0.0, []
    for i, v in enumerate(raw, 1):  # W&B / TensorBoard debiased EMA
        last = 0.6 * last + 0.4 * v
        expected.append(last / (1 - 0.6 ** i))
    drawn = browser.execute_script("return CHARTS[arguments[0]].plot.data;", loss)
    assert [round(v, 12) for v in drawn[1]] == [round(v, 12) for v in expected]
    assert drawn[2] == pytest.approx(raw)  # the raw series, drawn faintly behind
    assert _hover(browser, loss, 3) == _fmt(raw[3])  # the hover value is the stored number
    browser.save_screenshot(str(shots / "run-12-steps-smoothed.png"))
    _load(browser, site, runs["one"])  # the choice follows the user to another run's page
    assert browser.execute_script("return document.getElementById('chart-smoothing').value") == "0.6"
    _check_axes(browser, [0])
    browser.save_screenshot(str(shots / "run-1-step-smoothed.png"))
    browser.execute_script("window.localStorage.removeItem('turnstile.chartSmoothing')")
    console_clean(browser)


def test_csv_of_a_chart(browser, site, runs):
    _load(browser, site, runs["two"])
    chart = chart_id(browser, "grad norm (before clipping)")
    assert browser.find_element(By.CSS_SELECTOR, f'button.chart-csv[data-chart="{chart}"]').is_displayed()
    body = browser.execute_script("return chartCsv(CHARTS[arguments[0]].chart);", chart)
    rows = list(csv.reader(io.StringIO(body)))
    assert rows[0] == ["step", "grad norm"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == [(i, step_metrics(i, 2)["grad_norm"]) for i in range(2)]
    console_clean(browser)


def test_metrics_api_json_csv_and_problems(site, runs):
    base = f"{site['url']}/api/runs/{runs['nan_none']}/metrics"
    got = httpx.get(base, headers=AUTH, timeout=30)
    assert got.status_code == 200
    body = got.json()
    assert [r["step"] for r in body["steps"]] == [0, 1, 2]
    assert body["steps"][0]["loss"] == step_metrics(0, 3)["loss"]
    assert body["steps"][1]["loss"] is None and body["steps"][1]["grad_norm"] is None  # NaN and null
    assert body["steps"][2]["tokens_trained"] is None  # not recorded that step
    got = httpx.get(base, params={"format": "csv"}, headers=AUTH, timeout=30)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(got.text)))
    assert [r["step"] for r in table] == ["0", "1", "2"] and table[1]["loss"] == ""
    assert float(table[2]["grad_norm"]) == step_metrics(2, 3)["grad_norm"]
    bad = httpx.get(base, params={"format": "xml"}, headers=AUTH, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "format"
    missing = httpx.get(f"{site['url']}/api/runs/999999/metrics", headers=AUTH, timeout=30)
    assert missing.status_code == 404 and "999999" in missing.json()["error"]["message"]
