"""Helpers the dashboard's browser tests share: open a page, read a table, check the console."""
from __future__ import annotations

import httpx
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from support import AUTH

WAIT_S = 20


def open_page(browser, site, path: str) -> None:
    """Load `path` and wait for the document; the same path must answer 200 over HTTP (a 500
    page also renders in the browser, so readyState alone would not catch it)."""
    status = httpx.get(site["url"] + path, headers=AUTH, timeout=30).status_code
    assert status == 200, f"{path} answered HTTP {status}\n{site['log'].output()[-3000:]}"
    browser.get(site["url"] + path)
    WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script("return document.readyState") == "complete")


def console_clean(browser, allowed: tuple[str, ...] = ()) -> None:
    """No SEVERE entry in the browser log, except messages containing one of `allowed`."""
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
              and not any(a in e["message"] for a in allowed)]
    assert not severe, severe


def rows(browser, selector: str) -> list:
    return browser.find_elements(By.CSS_SELECTOR, f"{selector} tbody tr")


def text(browser, selector: str) -> str:
    return browser.find_element(By.CSS_SELECTOR, selector).text
