"""The playground at `/`: its files are served (without a key, even when the API needs one), and in a real
headless Chromium (Playwright's Python API driving the system's `chromium`) it streams text, sends the
slider's loops, runs the side-by-side depths and shows the API's figures. The screenshot goes to
`artifacts/playground.png` (gitignored; `TINYLOOP_ARTIFACTS` moves it).

The browser test needs `playwright` (the `test` extra) and a Chromium binary (`apt-get install chromium`,
which `.ci/run` does when it runs as root; `TINYLOOP_CHROMIUM` names another binary). Without them it is
skipped, with the reason in the skip message and in a warning in pytest's summary."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import httpx
import pytest

from tinyloop.server.settings import Settings

from .conftest import ServerThread

KEY = "playground-test-key"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def keyed_server(forced_model_path):
    """The forced model (its greedy continuation is known exactly) behind an API key."""
    with ServerThread(Settings(model_path=forced_model_path, api_key=KEY)) as srv:
        yield srv


def test_page_and_assets_are_served_without_a_key(keyed_server):
    url = keyed_server.url
    page = httpx.get(url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    for needle in ('id="loops"', 'id="mode"', 'href="/docs"', "/static/playground.js", "/static/playground.css"):
        assert needle in html
    js = httpx.get(url + "/static/playground.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert "/api/v0/completions" in js.text and "Authorization" in js.text
    css = httpx.get(url + "/static/playground.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    icon = httpx.get(url + "/favicon.ico")   # browsers ask for it (without a key): once a 404
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
    assert icon.content[:4] == b"\x00\x00\x01\x00" and 'href="/favicon.ico"' in html
    # the page is open, the API is not; nothing else of static/ is reachable
    assert httpx.get(url + "/api/v0/models").status_code == 401
    assert httpx.get(url + "/static/index.html", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert "/" not in httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]


def test_static_files_are_package_data():
    """The page ships inside the wheel: pyproject's package-data names the static files."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tinyloop"]
    assert "server/static/*" in data
    static = ROOT / "src" / "tinyloop" / "server" / "static"
    assert {"index.html", "playground.js", "playground.css"} <= {p.name for p in static.iterdir()}


# -- the real browser -----------------------------------------------------------------------------------------
def find_chromium() -> str | None:
    given = os.environ.get("TINYLOOP_CHROMIUM")
    if given:
        return given if Path(given).exists() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def skip_loudly(reason: str) -> None:
    msg = f"BROWSER TEST SKIPPED: {reason}. The playground was not tested in a browser."
    warnings.warn(msg, stacklevel=2)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_loudly("the playwright package is not installed (pip install -e '.[test]')")
    exe = find_chromium()
    if exe is None:
        skip_loudly("no Chromium binary found (apt-get install chromium, or set TINYLOOP_CHROMIUM)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def artifacts_dir() -> Path:
    out = Path(os.environ.get("TINYLOOP_ARTIFACTS") or ROOT / "artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


def expected_completion(url: str, prompt: str, max_tokens: int, loops: int) -> str:
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tinyloop", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "loops": loops})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_playground_in_a_real_browser(browser, keyed_server):
    t_start = time.monotonic()
    url = keyed_server.url
    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    bodies: list[dict] = []
    paths: list[str] = []

    def on_request(req) -> None:
        if req.method == "POST" and "/api/v0/" in req.url:
            bodies.append(req.post_data_json)
            paths.append(req.url.removeprefix(url))

    page.on("request", on_request)
    page.set_default_timeout(20_000)

    # the server wants a key: the page asks for it, then shows the model card
    page.goto(url + "/")
    page.wait_for_selector("#auth:not([hidden])")
    page.fill("#api-key", KEY)
    page.click("#auth-submit")
    page.wait_for_selector("#card-facts [data-fact='max loops']")
    assert page.inner_text("#card-facts [data-fact='max loops'] dd") == "64"
    assert page.inner_text("#card-facts [data-fact='default loops'] dd") == "3"
    assert page.get_attribute("#loops", "max") == "64" and page.input_value("#loops") == "3"
    assert page.get_attribute("a[href='/docs']", "href") == "/docs"

    # a prompt streams in: the text shown is the forced model's known greedy continuation
    prompt = "Hi"  # " Hi" is the first token of the forced model's cycle
    page.fill("#prompt", " " + prompt)
    page.fill("#max_tokens", "24")
    page.click("#send")
    page.wait_for_selector("#output[data-state=done]")
    shown = page.inner_text("#output .gen")
    assert shown == expected_completion(url, " " + prompt, 24, 3)
    assert shown.startswith("🙂 there said 日本 world")  # whole characters, though split over tokens on the wire
    assert int(page.get_attribute("#output", "data-events")) >= 2  # it arrived as a stream, not in one piece
    assert page.inner_text("#figures [data-fig=tokens] b") == "24"
    assert float(page.inner_text("#figures [data-fig=tps] b")) > 0
    assert "ms server" in page.inner_text("#figures [data-fig=ttft] b")
    assert bodies[-1]["loops"] == 3 and bodies[-1]["stream"] is True and bodies[-1]["mode"] == "generate"

    # the slider sets the request's loops
    page.eval_on_selector("#loops", "el => { el.value = '5'; el.dispatchEvent(new Event('input')); }")
    assert page.inner_text("#loops-value") == "5"
    page.click("#send")
    page.wait_for_selector("#output[data-state=done]")
    assert bodies[-1]["loops"] == 5
    assert page.inner_text("#figures [data-fig=loops] b") == "5"

    # speculative mode: its knobs go out, the API's acceptance rate comes back
    page.select_option("#mode", "speculative")
    page.fill("#draft_loops", "2")
    page.click("#send")
    page.wait_for_selector("#output[data-state=done]")
    sent = bodies[-1]
    assert sent["mode"] == "speculative" and sent["verify_loops"] == 5 and sent["draft_loops"] == 2
    assert "%" in page.inner_text("#figures [data-fig=acceptance] b")
    assert page.inner_text("#output .gen") == expected_completion(url, " " + prompt, 24, 5)  # exact under greedy
    assert page.is_hidden("#K_branches")  # a tree knob: only in tree mode
    page.select_option("#mode", "tree_speculative")
    page.fill("#K_branches", "2")
    page.click("#send")
    page.wait_for_selector("#output[data-state=done]")
    assert bodies[-1]["mode"] == "tree_speculative" and bodies[-1]["K_branches"] == 2
    assert page.inner_text("#output .gen") == expected_completion(url, " " + prompt, 24, 5)
    # an API error (draft deeper than the verifier) is shown, named as the server names it
    page.fill("#draft_loops", "6")
    page.click("#send")
    page.wait_for_selector("#output[data-state=error]")
    assert "400" in page.inner_text("#error") and "draft_loops" in page.inner_text("#error")
    page.fill("#draft_loops", "2")
    page.select_option("#mode", "generate")
    assert page.is_hidden("#draft_loops")

    # side by side: three depths, three columns streaming the same prompt together
    n_before = len(bodies)
    page.fill("#depth-0", "1")
    page.fill("#depth-1", "2")
    page.fill("#depth-2", "4")
    page.click("#compare-run")
    page.wait_for_function("document.querySelectorAll('#columns pre[data-state=done]').length === 3")
    assert sorted(b["loops"] for b in bodies[n_before:]) == [1, 2, 4]
    for col in page.query_selector_all("#columns .column"):
        assert "said 日本 world" in col.query_selector(".gen").inner_text()
        assert col.query_selector("[data-fig=loops] b").inner_text() == col.get_attribute("data-loops")

    # chat: the transcript keeps the turn
    page.check("input[name=kind][value=chat]")
    page.fill("#prompt", "Hi")
    page.click("#send")
    page.wait_for_selector("#output[data-state=done]")
    assert paths[-1] == "/api/v0/chat/completions" and bodies[-1]["messages"] == [{"role": "user", "content": "Hi"}]
    assert bodies[-1]["stop"] == ["\nUser:"]
    page.wait_for_selector("#transcript .msg.assistant")
    # each answer is shown once: in the transcript, no longer also in the output box under it
    answer = page.inner_text("#transcript .msg.assistant").removeprefix("Assistant: ")
    assert answer and page.inner_text("#output").strip() == "", page.inner_text("#output")
    assert page.inner_text("#single").count(answer) == 1
    assert [m.inner_text() for m in page.query_selector_all("#transcript .msg")] == ["User: Hi", f"Assistant: {answer}"]
    page.fill("#prompt", "Again")      # a second turn: the conversation in order, each answer once
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('#transcript .msg').length === 4")
    assert bodies[-1]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer},
                                      {"role": "user", "content": "Again"}]
    assert page.inner_text("#output").strip() == ""
    page.check("input[name=kind][value=completion]")
    page.fill("#prompt", " " + prompt)
    page.click("#send")
    page.wait_for_selector("#output[data-state=done]")

    # adaptive depth: "auto" sends loops "auto" with the slider as the ceiling, and shades each token by the
    # loops it ran (the forced model's blocks are identities: every token may exit at once)
    page.check("#auto")
    page.click("#send")
    page.wait_for_selector("#output[data-state=done]")
    assert bodies[-1]["loops"] == "auto" and bodies[-1]["max_loops"] == 5
    spans = page.query_selector_all("#output .gen .depth")
    assert spans and "".join(sp.inner_text() for sp in spans) == page.inner_text("#output .gen")
    depths = [int(d) for sp in spans for d in sp.get_attribute("data-loops").split(",")]
    assert all(1 <= d <= 5 for d in depths) and len(depths) == 24
    assert spans[0].get_attribute("title").startswith("loops ") and "rgba" in spans[0].get_attribute("style")
    page.uncheck("#auto")

    shot = artifacts_dir() / "playground.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    assert not errors, errors
    page.close()
    assert time.monotonic() - t_start < 60
