"""Fixtures of the real-browser tier: Debian's chromium driven by selenium against a ComfyUI server that
serves its installed web frontend (``comfyui-frontend-package``, installed by ``scripts/setup_host.sh``).

* chromium + chromedriver are installed by ``scripts/setup_browser.sh`` (apt-get) when missing. When that
  fails the tier skips, unless ``VRAMFIT_REQUIRE_BROWSER`` is set (CI sets it): then it fails.
* Screenshots go to ``outputs/browser/<ComfyUI version>/`` (``VRAMFIT_BROWSER_OUT`` overrides the folder).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from scripts.host import ROOT, ComfyServer

REQUIRE_ENV = "VRAMFIT_REQUIRE_BROWSER"
OUT_ENV = "VRAMFIT_BROWSER_OUT"
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1920,1080", "--force-device-scale-factor=1",
)  # fmt: skip
FRONTEND_SETTINGS = {
    "Comfy.TutorialCompleted": True,  # no template browser popping up on the first visit
    "Comfy.VueNodes.Enabled": False,  # the classic canvas: the default of both frontends
    "LiteGraph.Canvas.MinFontSizeForLOD": 0,  # text and report boxes drawn at any zoom (whole-graph screenshots)
    # headless chromium renders on the CPU the server decodes on: draw less
    "LiteGraph.Canvas.MaximumFps": 10,
    "Comfy.Minimap.Visible": False,
}


def unavailable(reason: str) -> None:
    """Skip the tier, or fail it when ``VRAMFIT_REQUIRE_BROWSER`` is set."""
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{reason} ({REQUIRE_ENV} is set, so the browser tier may not skip)", pytrace=False)
    pytest.skip(reason)


def _find_browser() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """``(chromium, chromedriver)`` paths; installed with apt-get (scripts/setup_browser.sh) when missing."""
    found = _find_browser()
    if found is None:
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "setup_browser.sh")], capture_output=True, text=True, timeout=900
        )
        found = _find_browser()
        if found is None:
            unavailable(f"chromium/chromedriver could not be installed:\n{proc.stderr[-2000:]}")
    return found


@pytest.fixture(scope="session")
def frontend_version(host_config) -> str:
    """Version of the web frontend installed in the host's python (``comfyui-frontend-package``)."""
    probe = subprocess.run(
        [str(host_config.python), "-c", "import importlib.metadata as m; print(m.version('comfyui-frontend-package'))"],
        capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode != 0:
        unavailable(
            f"comfyui-frontend-package is not installed in {host_config.python}: run scripts/setup_host.sh "
            "(it installs the frontend unless VRAMFIT_FRONTEND=0)"
        )
    return probe.stdout.strip()


@pytest.fixture(scope="session")
def frontend_host(host_config, frontend_version):
    """The host's config with its installed web frontend served (``front_end_root=None``)."""
    return dataclasses.replace(host_config, front_end_root=None)


@pytest.fixture(scope="session")
def ui_server(frontend_host, fixture_vaes, tmp_path_factory):
    """A ComfyUI server with its web frontend, the fixture VAEs, and in its input folder what a fresh
    install has there (ComfyUI's example.png, which the CPU templates load)."""
    from scripts.workflows import copy_shipped_inputs

    server = ComfyServer(frontend_host, work_dir=tmp_path_factory.mktemp("ui-server"))
    copy_shipped_inputs(frontend_host.comfyui_path, server.input_dir)
    settings = server.user_dir / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(FRONTEND_SETTINGS))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def driver(chromium, tmp_path_factory):
    """One headless chromium for the session (fresh profile)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed (the dev extra of pyproject.toml)")
    browser, chromedriver = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    drv = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    drv.set_page_load_timeout(120)
    drv.set_script_timeout(60)
    yield drv
    drv.quit()


@pytest.fixture(scope="session")
def app_page(driver, ui_server):
    """The ComfyUI app loaded once in the session's browser tab."""
    from tests.browser.comfy_page import ComfyPage

    return ComfyPage(driver, ui_server.url).open()


@pytest.fixture
def page(app_page):
    """The session's app page with no dialog or toast left open by an earlier test."""
    app_page.close_overlays()
    return app_page


@pytest.fixture(scope="session")
def shots_dir(host_config) -> pathlib.Path:
    """Where the tier's screenshots go: ``outputs/browser/<ComfyUI version>/`` or ``$VRAMFIT_BROWSER_OUT``."""
    out = pathlib.Path(os.environ.get(OUT_ENV) or ROOT / "outputs" / "browser" / host_config.version)
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A screenshot of the page when a browser test fails: ``<shots_dir>/FAILED_<test name>.png``."""
    outcome = yield
    report = outcome.get_result()
    page = item.funcargs.get("page")
    if report.when == "call" and report.failed and page is not None:
        shots = item.funcargs.get("shots_dir") or ROOT / "outputs" / "browser"
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name)
        try:
            page.screenshot(pathlib.Path(shots) / f"FAILED_{name}.png")
        except Exception as e:  # the test's own failure is what matters
            report.sections.append(("screenshot", f"no screenshot: {e}"))
