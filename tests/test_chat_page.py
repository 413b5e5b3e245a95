"""The chat page at `/` in headless Chromium (Debian's chromium and chromium-driver, which .ci/run installs), against
a server on the embedded default model: a streamed answer, stop, a wrong key, the live view. A screenshot of the page
is kept in test-artifacts/chat_page.png."""
import shutil
import time
from pathlib import Path

import httpx
import pytest

from convert.cache import MODEL_NAME
from nanojax import LLM
from nanojax.serve import BackgroundServer, build_app

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver")

KEY = "page-key"
ARTIFACTS = Path(__file__).parents[1] / "test-artifacts"


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", max_model_len=1024, max_num_seqs=4)
    server = BackgroundServer(build_app(llm, MODEL_NAME, api_key=KEY))
    yield server
    server.stop()
    llm.close()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def wait_for(condition, timeout: float = 120, what: str = "the page"):
    deadline = time.time() + timeout
    while not (value := condition()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def by_id(driver, name: str):
    return driver.find_element("id", name)


def open_page(driver, url: str, key: str) -> None:
    driver.get(url)
    wait_for(lambda: by_id(driver, "model").text == MODEL_NAME, 30, "the model's name")
    field = by_id(driver, "api-key")
    field.clear()
    field.send_keys(key)


def ask(driver, question: str, max_tokens: int) -> None:
    for name, value in (("temperature", "0"), ("max-tokens", str(max_tokens))):
        by_id(driver, name).clear()
        by_id(driver, name).send_keys(value)
    by_id(driver, "prompt").send_keys(question)
    by_id(driver, "send").click()


def busy(driver) -> bool:
    return driver.execute_script("return document.body.dataset.busy") == "1"


def metric(url: str, name: str) -> float:
    line = next(x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_a_question_gets_a_streamed_answer_with_no_console_errors(server, browser):
    open_page(browser, server.url, KEY)
    ask(browser, "What is the capital of France?", 32)
    wait_for(lambda: not busy(browser), what="the answer")
    answer = browser.find_elements("css selector", ".message.assistant")[-1]
    assert "Paris" in answer.find_element("css selector", ".content").text
    assert "tokens" in answer.find_element("css selector", ".stats").text
    assert by_id(browser, "error").text == ""
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "chat_page.png"))


def test_stop_ends_the_stream_and_the_pages_come_back_while_the_live_view_moves(server, browser):
    open_page(browser, server.url, KEY)
    by_id(browser, "clear").click()
    updates = int(browser.execute_script("return document.body.dataset.metricsUpdates || '0'"))
    ask(browser, "Count from 1 to 300, one number per line.", 600)
    wait_for(lambda: busy(browser), 10, "the stream to start")
    # the live view shows the request holding pages while it runs
    wait_for(lambda: float(by_id(browser, "live-pages-used").text or 0) > 0 and by_id(browser, "live-running").text
             == "1", 30, "the live view to show the running request")
    wait_for(lambda: browser.find_elements("css selector", ".message.assistant .content")[-1].text, 60,
             "the first tokens")
    by_id(browser, "stop").click()
    wait_for(lambda: not busy(browser), 10, "the stop")
    stats = browser.find_elements("css selector", ".message.assistant .stats")[-1].text
    assert "stopped" in stats
    wait_for(lambda: metric(server.url, "nanojax_kv_pages_used") == 0
             and metric(server.url, "nanojax_requests_running") == 0, 30, "the pages to come back")
    assert int(browser.execute_script("return document.body.dataset.metricsUpdates")) > updates
    assert by_id(browser, "live-up").text == "up"


def test_a_wrong_key_shows_an_error(server, browser):
    open_page(browser, server.url, "wrong-key")
    ask(browser, "Hello", 8)
    wait_for(lambda: not busy(browser) and by_id(browser, "error").text, 30, "the error")
    assert "API key" in by_id(browser, "error").text


def test_code_is_rendered_and_regenerate_and_clear_work(server, browser):
    open_page(browser, server.url, KEY)
    by_id(browser, "clear").click()
    ask(browser, "Write a Python function that adds two numbers.", 40)
    wait_for(lambda: not busy(browser), what="the answer")
    code = browser.find_elements("css selector", ".message.assistant .content pre code")
    assert code and "def add_two_numbers" in code[0].text  # the model's fenced block, rendered as code
    first = browser.find_elements("css selector", ".message.assistant .content")[-1].text
    by_id(browser, "regenerate").click()
    wait_for(lambda: busy(browser), 10, "the regenerated stream")
    wait_for(lambda: not busy(browser), what="the regenerated answer")
    answers = browser.find_elements("css selector", ".message.assistant .content")
    assert len(answers) == 1 and answers[0].text == first  # replaced, and greedy gives the same again
    by_id(browser, "clear").click()
    assert not browser.find_elements("css selector", "#messages .message")
