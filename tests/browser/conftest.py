"""Fixtures of the real-browser tier: Debian's chromium driven by selenium against a ComfyUI server that
serves its installed web frontend (``comfyui-frontend-package``, installed by ``scripts/setup_host.sh``), or
the newest frontend (``scripts/setup_browser.sh frontend``) for the tests that parametrize ``frontend``.

* chromium + chromedriver are installed by ``scripts/setup_browser.sh`` (apt-get) when missing. When that
  fails the tier skips, unless ``VRAMFIT_REQUIRE_BROWSER`` is set (CI sets it): then it fails.
* One server and one browser tab at a time (:class:`UiSession`): ``page``/``ui_server`` are the host's own
  frontend on the classic canvas; ``ui_page`` is the frontend and node renderer a test parametrizes
  (``frontend`` in :data:`FRONTENDS`, ``renderer`` in :data:`RENDERERS`). A server starts when the frontend
  changes, the app reloads when the renderer changes: order such tests by frontend, then renderer.
* Screenshots go to ``outputs/browser/<ComfyUI version>/`` (``VRAMFIT_BROWSER_OUT`` overrides the folder).
* The variants (Vue nodes, the newest frontend) run where CI runs the tier (:func:`variants`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
from typing import Any

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
    "Comfy.VueNodes.Enabled": False,  # the classic canvas (the renderer of `page`); `ui_page` sets its own
    "LiteGraph.Canvas.MinFontSizeForLOD": 0,  # text and report boxes drawn at any zoom (whole-graph screenshots)
    # headless chromium renders on the CPU the server decodes on: draw less
    "LiteGraph.Canvas.MaximumFps": 10,
    "Comfy.Minimap.Visible": False,
}
FRONTENDS = ("pinned", "newest")
"""``pinned``: the host's own ``comfyui-frontend-package`` (its requirements.txt pin); ``newest``: the one
``scripts/setup_browser.sh`` installs into the cache (served with ``--front-end-root``)."""
RENDERERS = {"classic": False, "vue": True}
"""The node renderers: ``Comfy.VueNodes.Enabled`` of each."""


def variants() -> bool:
    """Whether the tier runs its variants (Vue nodes, the newest frontend) beside the host's own frontend on the
    classic canvas: where CI runs it (``VRAMFIT_REQUIRE_BROWSER``), or with ``VRAMFIT_BROWSER_VARIANTS=1``; a user's
    default test run keeps the one that ships with their ComfyUI (README's 15-minute budget)."""
    flag = os.environ.get("VRAMFIT_BROWSER_VARIANTS", "").strip()
    return flag not in ("", "0") if flag else bool(os.environ.get(REQUIRE_ENV))


def variant(frontend: str, renderer: str) -> None:
    """Skip a run on a frontend or renderer other than the host's own classic canvas unless :func:`variants`."""
    if (frontend, renderer) != ("pinned", "classic") and not variants():
        pytest.skip(f"browser variant {frontend}/{renderer}: runs where CI runs the tier (VRAMFIT_REQUIRE_BROWSER) "
                    "or with VRAMFIT_BROWSER_VARIANTS=1")


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


def newest_frontend_root(python: pathlib.Path) -> pathlib.Path:
    """The static folder of the newest frontend (``scripts/setup_browser.sh frontend``: installed when missing)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_browser.sh"), "frontend"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, VRAMFIT_PYTHON=str(python)),
    )  # fmt: skip
    root = pathlib.Path(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None
    if proc.returncode != 0 or root is None or not (root / "index.html").is_file():
        unavailable(f"the newest web frontend could not be installed:\n{proc.stderr[-2000:]}")
    return root


def write_settings(server: ComfyServer, settings: dict) -> None:
    """The frontend settings the app reads when it (re)loads (the user's ``comfy.settings.json``)."""
    path = server.user_dir / "default" / "comfy.settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings))


class UiSession:
    """The session's one ComfyUI server and one app tab. A server serves one frontend (``pinned`` or
    ``newest``): asking for the other stops it and starts one serving that; the tab reloads the app when the
    server or the node renderer (``classic``/``vue``, a setting read at load) changes."""

    def __init__(self, host, mktemp):
        self.host, self.mktemp = host, mktemp
        self.server: ComfyServer | None = None
        self.frontend: str | None = None
        self.page: Any = None
        self.renderer: str | None = None
        self._newest: pathlib.Path | None = None

    def server_for(self, frontend: str) -> ComfyServer:
        """A running server of ``frontend`` with the fixture VAEs, and in its input folder what a fresh
        install has there (ComfyUI's example.png, which the CPU templates load)."""
        from scripts.workflows import copy_shipped_inputs

        if self.server is not None and self.frontend == frontend:
            return self.server
        self.stop()
        root = None
        if frontend == "newest":
            self._newest = self._newest or newest_frontend_root(self.host.python)
            root = self._newest
        cfg = dataclasses.replace(self.host, front_end_root=root)
        server = ComfyServer(cfg, work_dir=self.mktemp(f"ui-server-{frontend}"))
        copy_shipped_inputs(cfg.comfyui_path, server.input_dir)
        write_settings(server, FRONTEND_SETTINGS)
        server.start()
        self.server, self.frontend = server, frontend
        return server

    def page_for(self, driver, frontend: str, renderer: str):
        """The app of ``frontend``'s server in the session's tab, its nodes drawn by ``renderer``."""
        from tests.browser.comfy_page import ComfyPage

        server = self.server_for(frontend)
        if self.page is None or self.page.url != server.url or self.renderer != renderer:
            write_settings(server, {**FRONTEND_SETTINGS, "Comfy.VueNodes.Enabled": RENDERERS[renderer]})
            self.page = ComfyPage(driver, server.url).open()
            self.renderer = renderer
        return self.page

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = self.frontend = self.page = self.renderer = None


@pytest.fixture(scope="session")
def ui_session(frontend_host, fixture_vaes, tmp_path_factory):
    """The session's :class:`UiSession` (the fixture VAEs in the host's models folder)."""
    session = UiSession(frontend_host, tmp_path_factory.mktemp)
    yield session
    session.stop()


@pytest.fixture
def ui_server(ui_session) -> ComfyServer:
    """A ComfyUI server serving the host's own web frontend."""
    return ui_session.server_for("pinned")


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


@pytest.fixture
def app_page(driver, ui_session):
    """The ComfyUI app of the host's own frontend on the classic canvas (loaded once while they stay)."""
    return ui_session.page_for(driver, "pinned", "classic")


@pytest.fixture
def page(app_page):
    """The session's app page with no dialog or toast left open by an earlier test."""
    app_page.close_overlays()
    return app_page


@pytest.fixture
def ui_page(driver, ui_session, frontend, renderer):
    """The app of ``frontend`` (``pinned``/``newest``) with ``renderer`` (``classic``/``vue``), both
    parametrized by the test, with no dialog or toast left open by an earlier test (a variant other than the host's
    own classic canvas only where :func:`variants`)."""
    variant(frontend, renderer)
    page = ui_session.page_for(driver, frontend, renderer)
    page.close_overlays()
    return page


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
    page = item.funcargs.get("page") or item.funcargs.get("ui_page")
    if report.when == "call" and report.failed and page is not None:
        shots = item.funcargs.get("shots_dir") or ROOT / "outputs" / "browser"
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name)
        try:
            page.screenshot(pathlib.Path(shots) / f"FAILED_{name}.png")
        except Exception as e:  # the test's own failure is what matters
            report.sections.append(("screenshot", f"no screenshot: {e}"))
