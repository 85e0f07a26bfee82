"""The console in a real browser (headless Chromium driven by Playwright) against a real
gateway with a real worker: keys, the model table, unload and load from the page, the
playground, the live chart under load, an inference key's limits, the phone layout.

Screenshots: with MLX_GATEWAY_SCREENSHOTS=DIR the desktop and phone views are written there
(docs/images holds the ones the README links); otherwise to the test's temporary folder.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gateway.edge.keys import KeyStore
from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no Chromium to drive: install Debian's chromium package (./dev test does)",
        allow_module_level=True,
    )

expect = playwright_api.expect
# Headless, and nothing that reaches for the network beyond the gateway on loopback.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def gw(chat_model: Path) -> Iterator[GatewayProc]:
    models = [{"name": "demo", "source": str(chat_model), "engine": {"max_context": 512}}]
    with running_gateway(models) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def keys(gw: GatewayProc) -> dict[str, str]:
    """An admin key and an inference key, created once the gateway runs (it re-reads the
    file): from then on every call needs one."""
    store = KeyStore(gw.run_dir / "keys.json")
    admin, _ = store.create("console-admin", scope="admin")
    user, _ = store.create("playground-user", scope="inference")
    return {"admin": admin, "inference": user}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"the page's script failed: {errors}"


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("MLX_GATEWAY_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def sign_in(page: Any, gw: GatewayProc, key: str) -> None:
    """Opens the gateway's address as a person would and enters the key at the prompt, from
    the keyboard (the prompt has the focus)."""
    page.goto(gw.base_url + "/")
    expect(page.locator("#key-input")).to_be_focused()
    page.keyboard.type(key)
    page.keyboard.press("Enter")
    expect(page.locator("#app")).to_be_visible()


def row(page: Any, model: str) -> Any:
    return page.locator(f'#models tbody tr[data-model="{model}"]')


def test_without_a_key_the_page_asks_for_one_and_its_calls_get_401(
    page: Any, gw: GatewayProc, keys: dict[str, str]
) -> None:
    statuses: list[tuple[str, int]] = []
    page.on("response", lambda r: statuses.append((r.url, r.status)))
    page.goto(gw.base_url + "/")
    assert page.url == gw.base_url + "/console"  # a browser at the root lands on the console
    expect(page.locator("#key-section")).to_be_visible()
    expect(page.locator("#app")).to_be_hidden()
    api = [status for url, status in statuses if "/console/api/" in url]
    assert api and set(api) == {401}, statuses
    # a wrong key: asked again, with the reason
    page.keyboard.type("mgw-00000000-not-a-key")
    page.keyboard.press("Enter")
    expect(page.locator("#key-error")).to_contain_text("invalid API key")
    expect(page.locator("#app")).to_be_hidden()
    assert "/console/api/" not in page.url and "mgw-" not in page.url  # never in a URL


def test_the_table_shows_the_model_ready_and_unload_and_load_work_from_the_page(
    page: Any, gw: GatewayProc, keys: dict[str, str]
) -> None:
    sign_in(page, gw, keys["admin"])
    demo = row(page, "demo")
    expect(demo.locator(".badge")).to_have_text("ready")
    expect(page.locator("#who")).to_contain_text("console-admin")
    pid = gw.ps()["demo"]["pid"]
    assert psutil.pid_exists(pid)
    page.evaluate("() => { window.notReloaded = true; }")

    unload = demo.get_by_role("button", name="Unload demo", exact=True)
    unload.focus()
    page.keyboard.press("Enter")  # from the keyboard
    wait_for(lambda: not _alive(pid), timeout=30, what="the demo worker to exit")
    expect(demo.locator(".badge")).to_have_text("unloaded")
    assert page.evaluate("() => window.notReloaded === true")  # updated in place
    # the button went disabled under the focus: the focus stayed in the model's row
    assert page.evaluate("""() => document.activeElement.closest('tr')?.dataset.model === 'demo'""")

    demo.get_by_role("button", name="Load demo", exact=True).click()
    expect(demo.locator(".badge")).to_have_text("ready")
    new_pid = gw.ps()["demo"]["pid"]
    assert new_pid != pid and psutil.pid_exists(new_pid)
    expect(page.locator("#action-status")).to_contain_text("demo: load done")
    # reload: a new worker takes over, the model stays ready
    demo.get_by_role("button", name="Reload demo", exact=True).click()
    expect(page.locator("#action-status")).to_contain_text("demo: reload done")
    expect(demo.locator(".badge")).to_have_text("ready")
    reloaded = gw.ps()["demo"]["pid"]
    assert reloaded not in (pid, new_pid) and psutil.pid_exists(reloaded)
    assert page.evaluate("() => window.notReloaded === true")
    # the machine: version, uptime, the memory budget's use
    expect(page.locator("#machine")).to_contain_text("Version ")
    expect(page.locator("#machine")).to_contain_text(" up ")
    expect(page.locator("#memory-text")).to_contain_text(" of ")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _screenshots(page: Any, shots: Path) -> None:
    """The desktop view, then the phone's: its layout fits the width (no sideways scroll of
    the page; wide tables scroll in their own box)."""
    page.locator("#chat-input").fill("Hello! What can you do?")
    page.locator("#chat-send").click()
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s")
    page.screenshot(path=str(shots / "console-desktop.png"), full_page=True)
    page.set_viewport_size(PHONE)

    def fits() -> bool:  # once the charts took the new width (a resize observer's turn)
        return bool(page.evaluate("() => document.documentElement.scrollWidth") <= PHONE["width"])

    wait_for(fits, timeout=10, what="the page to fit a phone's width")
    expect(page.locator('#models td[data-label="State"]').first).to_be_visible()
    page.screenshot(path=str(shots / "console-phone.png"), full_page=True)


def test_a_playground_message_streams_a_reply(
    page: Any, gw: GatewayProc, keys: dict[str, str]
) -> None:
    sign_in(page, gw, keys["inference"])
    expect(page.locator("#chat-model")).to_have_value("demo")
    with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as reply:
        page.locator("#chat-input").fill("Tell me about the sea.")
        page.locator("#chat-input").press("Enter")
    response = reply.value
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.request.post_data_json["stream"] is True
    answer = page.locator("#chat-log .msg.assistant .text")
    expect(answer).not_to_be_empty()
    expect(page.locator("#chat-stats")).to_contain_text("first token")
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s")
    # the reply is the stream's text, and the request is in the recent list with its key
    assert answer.inner_text().strip()
    recent = page.locator("#recent tbody tr").first
    expect(recent).to_contain_text("playground-user")
    expect(recent).to_contain_text("200")
    # forgetting the key forgets what it saw: the conversation, the tables, who it was
    page.locator("#forget").click()
    expect(page.locator("#key-section")).to_be_visible()
    expect(page.locator("#chat-log .msg")).to_have_count(0)
    expect(page.locator("#recent tbody tr")).to_have_count(0)
    expect(page.locator("#who")).to_be_empty()
    assert page.evaluate("() => sessionStorage.length") == 0


def test_the_live_chart_moves_while_a_load_generator_runs(
    page: Any, gw: GatewayProc, keys: dict[str, str], shots: Path
) -> None:
    sign_in(page, gw, keys["admin"])
    chart = page.locator("#chart-tokens canvas")
    expect(chart).to_be_visible()
    before = chart.screenshot()
    stop = threading.Event()
    client = openai_client(gw).with_options(api_key=keys["inference"])

    def generate() -> None:
        for _ in range(200):  # bounded
            if stop.is_set():
                return
            client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Go on."}], max_tokens=48
            )

    workers = [threading.Thread(target=generate) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        expect(page.locator("#now-tokens")).not_to_have_text("now 0.0")
        most = page.evaluate("() => Math.max(...window.mlxConsole.charts.tokens.data[1])")
        assert most > 0
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    # the line is drawn where it was flat (the canvas redraws on the next samples: a
    # loaded browser may take a few seconds)
    wait_for(lambda: chart.screenshot() != before, 15, "the chart redrawn")
    _screenshots(page, shots)  # with the figures of that load in the charts


def test_an_inference_key_sees_no_controls_and_gets_403_calling_them(
    page: Any, gw: GatewayProc, keys: dict[str, str]
) -> None:
    sign_in(page, gw, keys["inference"])
    expect(row(page, "demo").locator(".badge")).to_have_text("ready")
    expect(page.locator("#control-note")).to_contain_text("admin-scope key")
    assert page.locator("#models button").count() == 0
    expect(page.locator("th.actions-col")).to_be_hidden()
    status = page.evaluate(
        """async (key) => (await fetch('/console/api/models/unload', {
            method: 'POST', headers: {authorization: `Bearer ${key}`},
            body: JSON.stringify({model: 'demo'})})).status""",
        keys["inference"],
    )
    assert status == 403
    assert gw.ps()["demo"]["state"] == "ready"


# What a tab in the background looks like to its page (headless tabs are all visible).
HIDE = """(hidden) => {
  const values = [["hidden", hidden], ["visibilityState", hidden ? "hidden" : "visible"]];
  for (const [name, value] of values)
    Object.defineProperty(document, name, {value, configurable: true});
  document.dispatchEvent(new Event("visibilitychange"));
}"""


def test_tabs_in_the_background_free_their_connections_for_a_seventh(
    browser: Any, gw: GatewayProc, keys: dict[str, str]
) -> None:
    """A browser keeps six connections to a host: six tabs' live streams would hold them
    all and leave a seventh tab's page waiting. Hidden tabs close theirs, and open it again
    when shown."""
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(TIMEOUT_MS)
    try:
        tabs = []
        for _ in range(6):
            tab = context.new_page()
            sign_in(tab, gw, keys["inference"])
            tab.evaluate(HIDE, True)
            tabs.append(tab)
        seventh = context.new_page()
        sign_in(seventh, gw, keys["inference"])  # loads and gets its live state
        samples = "() => window.mlxConsole.history.length"
        first = tabs[0]
        first.evaluate(HIDE, False)  # shown again: its stream opens and samples arrive
        count = first.evaluate(samples)
        first.wait_for_function(f"() => window.mlxConsole.history.length > {count}")
        assert first.evaluate("() => window.mlxConsole.streamAbort !== null")
    finally:
        context.close()


# WCAG 2 contrast of each visible element's text against the first opaque background behind
# it: the lowest found, and where.
CONTRAST = """(selectors) => {
  const rgb = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const behind = (el) => {
    for (; el; el = el.parentElement) {
      const c = rgb(getComputedStyle(el).backgroundColor);
      if (c.length === 3 || c[3] > 0) return c;
    }
    return [255, 255, 255];
  };
  let worst = [99, ""];
  for (const el of document.querySelectorAll(selectors)) {
    if (!el.offsetParent || !el.textContent.trim() || el.disabled) continue;
    const a = lum(rgb(getComputedStyle(el).color)), b = lum(behind(el));
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    const where = el.tagName + "." + el.className + ": " + el.textContent.trim().slice(0, 30);
    if (ratio < worst[0]) worst = [ratio, where];
  }
  return worst;
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_text_keeps_aa_contrast_and_every_control_is_named_and_reachable_by_keyboard(
    browser: Any, gw: GatewayProc, keys: dict[str, str], scheme: str
) -> None:
    context = browser.new_context(viewport=DESKTOP, color_scheme=scheme)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    try:
        sign_in(page, gw, keys["admin"])
        expect(row(page, "demo").locator(".badge")).to_have_text("ready")
        selectors = "h1, h2, p, th, td, label, button, .badge, .muted, figcaption, .who-said"
        ratio, where = page.evaluate(CONTRAST, selectors)
        assert ratio >= 4.5, f"contrast {ratio:.2f} < 4.5 at {where}"
        unnamed = page.evaluate(
            """() => [...document.querySelectorAll('button, input, select, textarea')]
                .filter(el => el.offsetParent && !(el.labels && el.labels.length)
                        && !el.getAttribute('aria-label') && !el.textContent.trim())
                .map(el => el.outerHTML.slice(0, 80))"""
        )
        assert not unnamed
        reached = set()
        for _ in range(40):  # bounded: Tab through the page, collecting what takes focus
            page.keyboard.press("Tab")
            reached.add(page.evaluate(_FOCUSED))
        assert {"Unload demo", "Reload demo", "chat-model", "chat-input", "chat-send"} <= reached
    finally:
        context.close()


_FOCUSED = """() => { const el = document.activeElement;
  return el.getAttribute('aria-label') || el.id || el.textContent.trim(); }"""
