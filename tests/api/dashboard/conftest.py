"""The dashboard under test: seeded SQL, the real API under gunicorn, headless Chromium.

One site and one browser per module (starting them costs seconds; the pages only read, and
the tests that write make their own rows).  Chromium and chromedriver are Debian's packages
(`scripts/system_deps.sh`); selenium is given the driver's path, so nothing is downloaded.
Screenshots go to `TURNSTILE_SCREENSHOTS` when set, else to a temporary folder.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
import redis as redis_lib

from app import config, db
from app.tables import Base
from support import API_TOKEN, Proc, REDIS_BASE, ROOT, free_port, wait_for

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The API enqueues Celery messages (a run's start, a cancel); they go to a Redis database
# no other suite's workers read, so no worker elsewhere acts on this site's run ids.
REDIS_URL = f"{REDIS_BASE}/12"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Seeded database + `gunicorn app:create_app()`; yields {"url", "ids", "database"}."""
    tmp = tmp_path_factory.mktemp("dashboard")
    var = tmp / "var"
    var.mkdir()
    models = ROOT / "var" / "models"
    if models.is_dir():  # reuse the tokenizer cache `make model` built instead of rebuilding it
        (var / "models").symlink_to(models)
    url = f"sqlite:///{tmp / 'turnstile.db'}"
    # A lease plus a watchdog period of 30 min: a run seeded "now" is not late while the tests run
    # (a module takes minutes on a busy box); the seed's 3-hour-old queued run is.
    env = {"DATABASE_URL": url, "REDIS_URL": REDIS_URL, "TURNSTILE_VAR_DIR": str(var),
           "TURNSTILE_LEASE_TTL_S": "900", "TURNSTILE_WATCHDOG_INTERVAL_S": "900"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        config.reset_settings()
        db.dispose_engine()
        Base.metadata.create_all(db.get_engine())
        from support.dashboard_seed import seed

        ids = seed()
        port = free_port()
        api = Proc([f"{os.path.dirname(sys.executable)}/gunicorn", "-c", "workers/api_conf.py", "app:create_app()"],
                   {**os.environ, **env, "TURNSTILE_API_BIND": f"127.0.0.1:{port}", "TURNSTILE_API_WORKERS": "2"},
                   tmp / "api.log")
        base = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(f"{base}/api/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(up, 60, what=f"the API\n{api.output()[-3000:] if api.log_path.exists() else ''}")
            yield {"url": base, "ids": ids, "database": url, "log": api}
        finally:
            api.kill()
            db.dispose_engine()
            redis_lib.Redis.from_url(REDIS_URL).flushdb()
    config.reset_settings()


@pytest.fixture(scope="module")
def browser(site):
    """Headless Chromium signed in to `site` through its /login page (as a person would)."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail("headless Chromium is missing: `bash scripts/system_deps.sh` installs chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        _sign_in(driver, site["url"])
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where the tests save a screenshot of each page."""
    target = os.environ.get("TURNSTILE_SCREENSHOTS")
    path = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path



def _sign_in(driver, base: str) -> None:
    """Open a page, get sent to /login, paste the API token, land back on the page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(base + "/compare")
    WebDriverWait(driver, 30).until(EC.presence_of_element_located((By.ID, "login-form")))
    driver.find_element(By.ID, "token").send_keys(API_TOKEN)
    driver.find_element(By.ID, "login-form").submit()
    WebDriverWait(driver, 30).until(lambda d: d.current_url.endswith("/compare"))
