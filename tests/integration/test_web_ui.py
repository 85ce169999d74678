"""The built-in web page (GET /) in a real headless Chromium driven by Selenium.

One server of the default model, started with --api-key: the page asks for the key and sends it
on every call, while its static files are served without it. The chat's greedy reply is compared
with the API's for the same request; the stop button must leave the server with nothing running
and its KV slots free; the dashboard's samples and canvases must change under load; model output
holding HTML must show as text. A screenshot of each view goes to a temporary folder, or to
$SRT_WEB_UI_SCREENSHOT_DIR when set (SRT_WEB_UI_SCREENSHOT_DIR=docs renews the README's).

Skipped, with the reason, when Selenium or a Chromium and its chromedriver cannot be found
(`make setup` installs Debian's chromium and chromium-driver where apt-get is available).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time

import openai
import pytest
import requests

from tests.helpers.server import DEFAULT_TEST_ARGS, ServerProcess

API_KEY = "sk-web-ui-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a Python function that adds two numbers."


def _find(env: str, names: tuple[str, ...]) -> str | None:
    if os.environ.get(env):
        return os.environ[env]
    return next((p for p in map(shutil.which, names) if p), None)


def _browser_paths() -> tuple[str, str]:
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    chrome = _find("SRT_CHROMIUM", ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"))
    driver = _find("SRT_CHROMEDRIVER", ("chromedriver",))
    if chrome is None or driver is None:
        pytest.skip("no Chromium and chromedriver found (apt-get install chromium chromium-driver)")
    return chrome, driver


@pytest.fixture(scope="module")
def server():
    with ServerProcess([*DEFAULT_TEST_ARGS, "--api-key", API_KEY]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> str:
    return os.environ.get("SRT_WEB_UI_SCREENSHOT_DIR") or str(tmp_path_factory.mktemp("web-ui"))


@pytest.fixture(scope="module")
def page(server):
    chrome, driver_path = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,900")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def state(server) -> dict:
    r = requests.get(server.url("/dashboard_state"), headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def set_field(driver, element_id: str, value: str) -> None:
    el = driver.find_element("id", element_id)
    el.clear()
    if value:
        el.send_keys(value)


def replies(driver) -> list[dict]:
    return driver.execute_script("return srt.chat.state.replies")


def test_page_asks_for_key_and_loads_without_errors(server, page):
    # the page's files need no key; its data does
    for path in ("/", "/web/main.js", "/web/style.css"):
        assert requests.get(server.url(path), timeout=10).status_code == 200, path
    assert requests.get(server.url("/web/nothing.js"), timeout=10).status_code == 404
    assert requests.get(server.url("/dashboard_state"), timeout=10).status_code == 401
    page.get(server.url("/"))
    wait_for(
        lambda: page.execute_script("return document.getElementById('key-dialog').open"), what="key dialog"
    )
    page.find_element("id", "key-input").send_keys(API_KEY)
    page.find_element("id", "key-submit").click()
    wait_for(lambda: page.find_element("id", "model-name").text == MODEL, what="model name")
    wait_for(lambda: page.execute_script("return srt.dashboard.samples.length") >= 1, what="first sample")
    assert page.execute_script("return sessionStorage.getItem('srt-api-key')") == API_KEY
    assert console_errors(page) == []


def test_chat_streams_the_greedy_reply(page, client, shots):
    set_field(page, "temperature", "0")
    set_field(page, "max-tokens", "32")
    page.find_element("id", "prompt").send_keys(PROMPT)
    page.find_element("id", "send").click()
    reply = wait_for(lambda: (r := replies(page)) and r[-1], what="reply")
    ref = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0, top_p=1, max_tokens=32
    )
    assert reply["error"] is None
    assert reply["content"] == ref.choices[0].message.content
    assert reply["finish"] == ref.choices[0].finish_reason
    assert reply["chunks"] > 1  # streamed, not delivered at once
    assert reply["usage"]["completion_tokens"] == ref.usage.completion_tokens
    assert reply["ttftMs"] > 0 and reply["metrics"]["e2e_latency"] > 0
    stats = page.find_element("css selector", ".msg-assistant .stats").text
    assert "TTFT" in stats and "tok/s" in stats and "server: queue" in stats
    page.save_screenshot(os.path.join(shots, "web_ui_chat.png"))
    assert console_errors(page) == []


def test_stop_button_frees_the_request(server, page):
    before = state(server)["scheduler"]["num_aborted"]
    set_field(page, "extra-fields", '{"ignore_eos": true}')
    set_field(page, "max-tokens", "4000")
    page.find_element("id", "prompt").send_keys("Count from one to one thousand.")
    page.find_element("id", "send").click()
    n = len(replies(page))
    wait_for(
        lambda: page.execute_script(
            "const b = document.querySelectorAll('.msg-assistant .body'); return b[b.length - 1].textContent"
        ),
        what="the first tokens",
    )
    assert state(server)["scheduler"]["num_running_reqs"] == 1
    page.find_element("id", "stop").click()
    reply = wait_for(lambda: len(r := replies(page)) > n and r[-1], what="the stopped reply")
    assert reply["finish"] == "stopped" and reply["error"] is None
    freed = wait_for(
        lambda: (
            (s := state(server))["scheduler"]["num_running_reqs"] == 0
            and s["requests"]["in_flight"] == 0
            and s
        ),
        timeout_s=10,
        what="the server to drop the request",
    )
    sched = freed["scheduler"]
    assert sched["num_aborted"] == before + 1
    assert sched["available_size"] + sched["evictable_size"] == sched["max_total_num_tokens"]
    assert page.find_element("id", "send").is_enabled()
    set_field(page, "extra-fields", "")


def test_settings_shape_the_request(page):
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    set_field(page, "system-prompt", "Answer in JSON.")
    set_field(page, "json-schema", schema)
    set_field(page, "top-p", "0.9")
    page.execute_script("srt.chat.state.messages.push({role: 'user', content: 'hi'})")
    body = page.execute_script("const b = srt.chat.buildRequest(); srt.chat.state.messages.pop(); return b")
    # the system prompt first, then the conversation so far, ending with the new message
    assert body["messages"][0] == {"role": "system", "content": "Answer in JSON."}
    assert body["messages"][-1] == {"role": "user", "content": "hi"}
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": json.loads(schema)},
    }
    assert body["top_p"] == 0.9 and body["stream"] and body["return_timings"]
    # a schema that is not JSON is refused in the page, before any request
    set_field(page, "json-schema", "{not json")
    n = len(replies(page))
    page.find_element("id", "prompt").send_keys("hello")
    page.find_element("id", "send").click()
    reply = wait_for(lambda: len(r := replies(page)) > n and r[-1], what="the refusal")
    assert reply["error"].startswith("JSON schema:") and reply["content"] == ""
    for field, value in (("system-prompt", ""), ("json-schema", ""), ("top-p", "1")):
        set_field(page, field, value)


def _load(client: openai.OpenAI) -> None:
    def one(i: int) -> None:
        # long enough (seconds) that the once-a-second poll samples it running
        client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            max_tokens=160,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(4)))


def test_dashboard_charts_follow_a_load(page, client, shots):
    page.find_element("id", "tab-dashboard").click()
    canvas = "return document.getElementById('chart-throughput').toDataURL()"
    samples_js = "return srt.dashboard.samples"
    wait_for(lambda: page.execute_script(samples_js), what="a first sample")
    before = page.execute_script(samples_js)[-1]
    start = len(page.execute_script(samples_js))
    draws = page.execute_script("return srt.dashboard.charts.requests.draws")
    image = page.execute_script(canvas)
    _load(client)
    generated = before["scheduler"]["num_generated_tokens"]
    wait_for(
        lambda: (
            page.execute_script(samples_js)[-1]["scheduler"]["num_generated_tokens"] >= generated + 4 * 160
        ),
        what="a sample after the load",
    )
    wait_for(
        lambda: any(p["values"].get("tokPerS") for p in page.execute_script("return srt.dashboard.points")),
        what="a throughput point",
    )
    samples = page.execute_script(samples_js)[start:]
    assert max(s["scheduler"]["num_running_reqs"] for s in samples) > 0
    assert samples[-1]["requests"]["itl"]["count"] > before["requests"]["itl"]["count"]
    assert any(p["values"].get("ttft50") for p in page.execute_script("return srt.dashboard.points"))
    assert page.execute_script("return srt.dashboard.charts.requests.draws") > draws
    assert page.execute_script(canvas) != image
    config = page.find_element("id", "config-table").text
    assert MODEL in config and samples[-1]["config"]["attention_backend"] in config
    page.save_screenshot(os.path.join(shots, "web_ui_dashboard.png"))
    assert console_errors(page) == []


# a reply crafted to break out of text: tags, an event handler, markup inside code
HOSTILE = (
    'Hi <script>window.__xss = 1</script> <img src=x onerror="window.__xss = 2"> **bold** `<b>x</b>`\n\n'
    "```html\n<script>window.__xss = 3</script>\n```\n- <iframe src=javascript:alert(1)>"
)


def test_model_output_is_never_html(page):
    page.find_element("id", "tab-chat").click()
    # the chat path end to end, with the server's stream replaced by one carrying HOSTILE
    page.execute_script(
        """
        const text = arguments[0];
        const real = srt.api.fetch;
        srt.api.fetch = async () => {
          srt.api.fetch = real;
          const ev = (o) => `data: ${JSON.stringify(o)}\\n\\n`;
          const half = Math.floor(text.length / 2);
          const body = ev({choices: [{index: 0, delta: {content: text.slice(0, half)}}]}) +
            ev({choices: [{index: 0, delta: {content: text.slice(half)}, finish_reason: "stop"}]}) +
            "data: [DONE]\\n\\n";
          return new Response(body, {headers: {"Content-Type": "text/event-stream"}});
        };
        srt.chat.send("say something");
        """,
        HOSTILE,
    )
    wait_for(lambda: replies(page)[-1]["content"] == HOSTILE, what="the crafted reply")
    body = page.find_elements("css selector", ".msg-assistant .body")[-1]
    assert (
        page.execute_script("return arguments[0].querySelectorAll('script, img, iframe, b').length", body)
        == 0
    )
    text = body.text
    assert "<script>window.__xss = 1</script>" in text and "<iframe src=javascript:alert(1)>" in text
    assert body.find_element("css selector", "strong").text == "bold"
    assert body.find_element("css selector", "pre code").text == "<script>window.__xss = 3</script>"
    assert page.execute_script("return window.__xss === undefined")
