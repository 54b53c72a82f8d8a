"""An eval run's per-instance pass@1 / pass@k and the Compare page's paired difference and warnings,
in headless Chromium; expected numbers come from `app.stats` over the seeded rows."""
from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC

from api.dashboard.compare_seed import CASES, REFUSALS, seed_pairs
from api.dashboard.pages import console_clean, open_page, rows, text, wait_until
from app.api.configdiff import config_diff
from app.api.dashboard.compare import REPLICATES
from app.control.heldout import samples as instance_samples
from app.db import session_scope
from app.stats import compare_samples, pass_at_k, wilson
from app.tables import Run


@pytest.fixture(scope="module")
def pairs(site):
    return seed_pairs()


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


def test_compare_shows_the_paired_difference_with_its_interval(browser, site, pairs, shots):
    a, b = pairs["before"], pairs["after"]
    open_page(browser, site, f"/compare?a={a}&b={b}")
    with session_scope() as s:
        expected = compare_samples(instance_samples(s, a), instance_samples(s, b), replicates=REPLICATES, seed=0)
    d = expected.difference
    shown = text(browser, "#compare-difference")
    assert f"{d.value:+.3f}" in shown and f"[{d.low:+.3f}, {d.high:+.3f}]" in shown
    assert ("better" in shown) == (d.low > 0)
    assert not browser.find_elements(By.ID, "compare-warnings")  # two completed evals of the same instances
    assert not browser.find_elements(By.ID, "compare-refused")
    assert text(browser, "#compare-heldout").startswith("Held-out")  # the after run's instances: none trained on
    browser.save_screenshot(str(shots / "compare-paired.png"))
    console_clean(browser)


@pytest.mark.parametrize("case, reason", REFUSALS)
def test_compare_page_refuses_with_a_notice_and_compares_when_forced(browser, site, pairs, case, reason):
    a, b = (pairs[k] for k in CASES[case])
    open_page(browser, site, f"/compare?a={a}&b={b}")
    notice = text(browser, "#compare-refused")
    assert f"Runs #{a} and #{b} cannot be compared" in notice and reason in notice
    assert not browser.find_elements(By.ID, "compare")  # no numbers for a refused pair
    browser.find_element(By.ID, "compare-force").click()
    wait_until(browser, EC.presence_of_element_located((By.ID, "compare")), timeout=30)
    assert "force=1" in browser.current_url and not browser.find_elements(By.ID, "compare-refused")
    assert reason in text(browser, "#compare-warnings")
    assert text(browser, "#compare-heldout").startswith("Not a held-out comparison")
    console_clean(browser)


def test_compare_page_shows_the_config_diff(browser, site, pairs):
    a, b = pairs["before"], pairs["after"]
    open_page(browser, site, f"/compare?a={a}&b={b}")
    row = browser.find_element(By.CSS_SELECTOR, '#compare-config tr[data-key="model.checkpoint"]').text
    assert row == f'model.checkpoint changed null "run:{pairs["train"]}"'
    with session_scope() as s:
        expected = config_diff(s.get(Run, a).config, s.get(Run, b).config)
    keys = [r.get_attribute("data-key") for r in browser.find_elements(By.CSS_SELECTOR, "#compare-config tbody tr")]
    assert keys == [d["key"] for d in expected] and "instances" not in keys  # only the keys that differ
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
