"""Helpers the dashboard's browser tests share: open a page, read a table, check the console."""
from __future__ import annotations

import httpx
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from support import AUTH

WAIT_S = 20


def wait_until(browser, condition, message: str = "", *, timeout: float = WAIT_S):
    """`condition(browser)`'s first truthy value within `timeout` seconds (selenium's
    WebDriverWait).  A condition that read an element the page replaced meanwhile is tried again:
    a live page re-renders whole sections on each poll (dashboard.js, runs.js), so an element
    found a moment ago can be detached by the time its text is read (StaleElementReferenceException).
    `message` goes into the TimeoutException raised when the time runs out."""
    return WebDriverWait(browser, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(condition, message)


def open_page(browser, site, path: str) -> None:
    """Load `path` and wait for the document; the same path must answer 200 over HTTP (a 500
    page also renders in the browser, so readyState alone would not catch it)."""
    status = httpx.get(site["url"] + path, headers=AUTH, timeout=30).status_code
    assert status == 200, f"{path} answered HTTP {status}\n{site['log'].output()[-3000:]}"
    browser.get(site["url"] + path)
    wait_until(browser, lambda d: d.execute_script("return document.readyState") == "complete")


def console_clean(browser, allowed: tuple[str, ...] = ()) -> None:
    """No SEVERE entry in the browser log, except messages containing one of `allowed`."""
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
              and not any(a in e["message"] for a in allowed)]
    assert not severe, severe


def rows(browser, selector: str) -> list:
    return browser.find_elements(By.CSS_SELECTOR, f"{selector} tbody tr")


def text(browser, selector: str) -> str:
    return browser.find_element(By.CSS_SELECTOR, selector).text


X_SCALE_JS = "const x = CHARTS[arguments[0]].plot.scales.x; return [x.min, x.max];"


def chart_id(browser, title: str) -> str:
    """The element id of the run page's chart titled `title`."""
    return browser.find_element(By.CSS_SELECTOR, f'figure.chart[data-title="{title}"]').get_attribute("id")


def x_scale(browser, chart: str) -> list:
    """[min, max] of chart `chart`'s x scale (steps), as uPlot holds it."""
    return browser.execute_script(X_SCALE_JS, chart)


def drag_zoom(browser, chart: str, start: float, by: float) -> None:
    """Drag across chart `chart`'s plot area from `start` (a fraction of its width, off its centre:
    -0.5 is the left edge) `by` a fraction of its width to the right."""
    over = browser.find_element(By.CSS_SELECTOR, f"#{chart} .u-over")
    width = over.size["width"]
    ActionChains(browser).move_to_element_with_offset(over, int(width * start), 0).click_and_hold() \
        .move_by_offset(int(width * by), 0).release().perform()


def reset_zoom(browser, chart: str) -> None:
    browser.find_element(By.CSS_SELECTOR, f'button.chart-reset[data-chart="{chart}"]').click()
