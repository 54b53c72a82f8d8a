"""An eval run's per-instance pass@1 / pass@k and the Compare page's paired difference and warnings,
in headless Chromium; expected numbers come from `app.stats` over the seeded rows."""
from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from api.dashboard.pages import console_clean, open_page, rows, text
from app.api.dashboard.compare import REPLICATES
from app.control.heldout import samples as instance_samples
from app.db import session_scope
from app.stats import compare_samples, pass_at_k, wilson


def test_eval_page_shows_pass_at_1_and_pass_at_k_per_instance(browser, site, shots):
    run_id = site["ids"]["eval_trained"]
    open_page(browser, site, f"/runs/{run_id}")
    with session_scope() as s:
        samples = instance_samples(s, run_id)
    assert len(rows(browser, "#eval-results")) == len(samples) == 3
    for name, flags in samples.items():
        row = browser.find_element(By.CSS_SELECTOR, f'#eval-results tr[data-instance="{name}"]').text
        n, c = len(flags), sum(flags)
        low, high = wilson(c, n)
        assert f"{c}/{n}" in row and f"{c / n:.2f} [{low:.2f}, {high:.2f}]" in row and f"{pass_at_k(n, c, 4):.2f}" in row
    assert "7/12" in text(browser, "#eval-overall")
    assert "No completed training steps" not in browser.page_source  # an eval has no steps to wait for
    browser.save_screenshot(str(shots / "run-eval.png"))
    console_clean(browser)


def test_compare_shows_the_paired_difference_with_its_interval(browser, site, shots):
    a, b = site["ids"]["eval_base"], site["ids"]["eval_trained"]
    open_page(browser, site, f"/compare?a={a}&b={b}")
    with session_scope() as s:
        expected = compare_samples(instance_samples(s, a), instance_samples(s, b), replicates=REPLICATES, seed=0)
    d = expected.difference
    shown = text(browser, "#compare-difference")
    assert f"{d.value:+.3f}" in shown and f"[{d.low:+.3f}, {d.high:+.3f}]" in shown
    assert ("better" in shown) == (d.low > 0)
    assert not browser.find_elements(By.ID, "compare-warnings")  # two completed evals of the same instances
    browser.save_screenshot(str(shots / "compare-paired.png"))
    console_clean(browser)


@pytest.mark.parametrize("other, warning", [
    ("train", "is a train run, not an eval"),
    ("cancelling_eval", "is cancelling: its results are partial"),
])
def test_compare_warns_when_kinds_states_or_instances_differ(browser, site, other, warning):
    a, b = site["ids"][other], site["ids"]["eval_trained"]
    open_page(browser, site, f"/compare?a={a}&b={b}")
    warnings = text(browser, "#compare-warnings")
    assert warning in warnings
    with session_scope() as s:
        names_a, names_b = set(instance_samples(s, a)), set(instance_samples(s, b))
    assert names_a != names_b  # both seeded runs sampled fewer instances than the eval
    assert "sampled different instances" in warnings and f"the {len(names_a & names_b)} shared instances only" in warnings
    unshared = browser.find_elements(By.CSS_SELECTOR, "#compare tr.unshared")
    assert {r.get_attribute("data-instance") for r in unshared} == names_a ^ names_b
    assert f"({len(names_a & names_b)} shared instances)" in text(browser, "#compare-overall")
    console_clean(browser)


def test_runs_made_from_one_another_link_to_each_other(browser, site):
    train, trained_eval = site["ids"]["train"], site["ids"]["eval_trained"]  # the eval's model is run:<train>
    open_page(browser, site, f"/runs/{trained_eval}")
    link = browser.find_element(By.CSS_SELECTOR, "#run-related a")
    assert link.text == f"run #{train}" and link.get_attribute("href").endswith(f"/runs/{train}")
    open_page(browser, site, f"/runs/{train}")
    assert f"#{trained_eval} (eval, completed)" in text(browser, "#run-related")
    open_page(browser, site, f"/runs/{site['ids']['eval_base']}")
    assert not browser.find_elements(By.ID, "run-related")
    console_clean(browser)


pytestmark = pytest.mark.timeout(300)
