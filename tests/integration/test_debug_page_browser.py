"""The debug page in a real browser against a running picker: Debian's headless Chromium driven by its
chromedriver (selenium, pointed at /usr/bin/chromedriver: tools that download their own browser fail offline).

The stack is the usual local gateway (tests/stack.py: real Envoy, trtllm-mock workers and renderer, the picker
in-process). One worker is named with markup and one request names a model with markup: the page must show
both as text and run neither. `.ci/run` installs `chromium chromium-driver` so CI runs this; elsewhere it is
skipped when the driver is absent. The screenshot is kept under the test's tmp dir (its path is printed), and
copied to `$EPP_DEBUG_PAGE_SCREENSHOT` when that is set (how bench/results/debug-page.png was made).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stack import GatewayStack
from tests.waiting import SCALE

CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM = Path("/usr/bin/chromium")
if not CHROMEDRIVER.exists() or not CHROMIUM.exists():
    pytest.skip("needs Debian's chromium and chromium-driver (/usr/bin/chromedriver): "
                "apt-get install chromium chromium-driver (.ci/run does)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extras)")

from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WORKER_NAME = "<img src=x onerror=alert('worker')>"
MODEL_NAME = "<script>alert('model')</script>"
WAIT_S = 20 * SCALE


class MarkupNamedStack(GatewayStack):
    """The local gateway, its first worker named with markup (the `--endpoints` name of `worker-0`)."""

    def endpoints_spec(self) -> str:
        return super().endpoints_spec().replace("worker-0=", WORKER_NAME + "=", 1)


@pytest.fixture(scope="module")
def stack() -> Iterator[GatewayStack]:
    s = MarkupNamedStack(workers=3).start()
    yield s
    s.stop()


@pytest.fixture
def browser() -> Iterator[Any]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1250", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def chat(stack: GatewayStack, text: str, model: str = "mock-model") -> None:
    stack.chat([{"role": "user", "content": text}], model=model)


def no_alert(driver: Any) -> bool:
    try:
        _ = driver.switch_to.alert
    except NoAlertPresentException:
        return True
    return False


def test_the_page_shows_the_pool_and_new_decisions_as_text_with_no_console_error(
        stack: GatewayStack, browser: Any, tmp_path: Path) -> None:
    app = stack.app
    assert app is not None
    names = {ep.name for ep in app.registry.all()}
    assert WORKER_NAME in names and len(names) == 3
    wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.1)
    browser.get(f"http://127.0.0.1:{app.admin_port}/debug/page")

    # every worker of the pool, names as text
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#pool-rows tr")) == 3)
    shown = {e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, "#pool-rows td.worker-name")}
    assert shown == names

    # a decision made after the page opened (its first poll armed the ring) shows up, with its markup model
    wait.until(lambda d: d.find_element(By.ID, "decisions-note").get_attribute("textContent"))
    prompt = "a prompt long enough to fill a few KV blocks " * 20
    for i in range(4):  # distinct prompts, then one repeated (credited blocks on its worker)
        chat(stack, f"{i} {prompt}")
    chat(stack, prompt)
    chat(stack, prompt)
    chat(stack, prompt, model=MODEL_NAME)
    wait.until(lambda d: any(e.get_attribute("textContent") == MODEL_NAME
                             for e in d.find_elements(By.CSS_SELECTOR, "#decision-rows td.model")))
    rows = browser.find_elements(By.CSS_SELECTOR, "#decision-rows tr")
    assert len(rows) >= 4
    picks = " ".join(e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, "td.pick"))
    chips = " ".join(e.get_attribute("textContent") for e in browser.find_elements(By.CSS_SELECTOR, ".chip"))
    assert WORKER_NAME in chips or WORKER_NAME in picks  # the markup worker is a candidate of every decision

    # the form asks /debug/score and shows its answer
    browser.find_element(By.ID, "score-model").send_keys("mock-model")
    browser.find_element(By.ID, "score-input").send_keys(prompt)
    browser.find_element(By.CSS_SELECTOR, "#score-form button[type=submit]").click()
    wait.until(lambda d: "pick:" in d.find_element(By.ID, "score-result").get_attribute("textContent"))
    answer = json.loads(browser.find_element(By.CSS_SELECTOR, "#score-result pre").get_attribute("textContent"))
    assert answer["route"] == "kv" and answer["pick"] in {m.address for m in stack.mocks}

    time.sleep(2.0)  # a refresh or two more: any script the markup smuggled in would have run by now
    assert no_alert(browser), "a name's markup ran as script"
    assert browser.find_elements(By.TAG_NAME, "img") == []  # the worker name made no element
    assert len(browser.find_elements(By.TAG_NAME, "script")) == 1  # the page's own, nothing injected
    assert browser.execute_script("return document.getElementById('status').className") != "bad"
    browser.execute_script("window.scrollTo(0, 0)")
    shot = tmp_path / "debug-page.png"
    assert browser.save_screenshot(str(shot))
    print(f"debug page screenshot: {shot}")
    if os.environ.get("EPP_DEBUG_PAGE_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["EPP_DEBUG_PAGE_SCREENSHOT"])
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == [], errors


def test_a_page_from_another_host_name_is_refused_by_the_browser_path_too(stack: GatewayStack, browser: Any) -> None:
    """What a DNS-rebinding page sees: the admin port answers its Host with 403, not the data."""
    app = stack.app
    assert app is not None
    # Chromium resolves any *.localhost name to loopback itself, so this reaches the admin port under a name
    # that is not one the guard allows (as a rebinding name would)
    browser.get(f"http://rebind.localhost:{app.admin_port}/debug/pool")
    assert "403" in browser.find_element(By.TAG_NAME, "body").get_attribute("textContent")
