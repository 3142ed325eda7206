"""A ComfyUI page in a real browser (selenium), driven the way a user drives it.

Clicks go through the real UI (menu, template dialog, Run button); what the frontend holds (the graph,
node widgets, executed events) is read with ``driver.execute_script``. Works with the frontends of both
supported hosts (1.32.x of ComfyUI 0.3.75, 1.49.x of ComfyUI 0.33) and the newest one (1.58.x), on the classic
canvas and with Vue nodes (``Comfy.VueNodes.Enabled``: each node is a DOM element ``.lg-node[data-node-id]``).
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

from selenium.common.exceptions import (
    ElementClickInterceptedException,
    JavascriptException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

EXTENSION = "VRAMFit.Reports"
REPORT_WIDGET = "vramfit_report"
VERDICT_SELECTOR = ".vramfit-verdict"
"""The verdict header of a report widget: the report's one-line verdict, shown above the text box."""
PACK_PREFIX = "VRAMFit_"
PACK_FOLDER = "ComfyUI-VRAM-Fit"  # the template browser lists the pack under its custom_nodes folder name

_READY_JS = """
const app = window.app;
return !!(app && app.graph && window.LiteGraph && window.comfyAPI?.api?.api
  && app.extensions?.some((e) => e.name === arguments[0])
  && window.LiteGraph.registered_node_types[arguments[1]]);
"""

_GRAPH_JS = """
const g = window.app.graph;
const nodes = g.nodes ?? g._nodes;
const links = g.links;
return {
  nodes: nodes.map((n) => ({id: String(n.id), type: n.type, registered: !!LiteGraph.registered_node_types[n.type]})),
  links: links instanceof Map ? links.size : (links?.size ?? Object.keys(links ?? {}).length),
  title: window.app.extensionManager?.workflow?.activeWorkflow?.filename ?? null,
};
"""

_RECORDER_JS = """
if (!window.__vramfitEvents) {
  const events = (window.__vramfitEvents = []);
  const api = window.comfyAPI.api.api;
  for (const type of ["execution_start", "execution_success", "execution_error", "execution_interrupted"]) {
    api.addEventListener(type, (e) => events.push({type, detail: e.detail ?? null}));
  }
  // A prompt ComfyUI rejects (validation) sends no execution event: record the queue call's outcome.
  const queuePrompt = api.queuePrompt.bind(api);
  api.queuePrompt = async (...args) => {
    try {
      const result = await queuePrompt(...args);
      events.push({type: "queued", detail: result ?? null});
      return result;
    } catch (e) {
      events.push({type: "rejected", detail: {message: String(e?.message ?? e), response: e?.response ?? null}});
      throw e;
    }
  };
}
return window.__vramfitEvents.length;
"""
_FINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted", "rejected")

_VUE_NODE_JS = "const vueNode = (id) => document.querySelector(`.lg-node[data-node-id=\"${id}\"]`);"

_REPORTS_JS = _VUE_NODE_JS + """
const g = window.app.graph;
return (g.nodes ?? g._nodes).filter((n) => n.type.startsWith(arguments[0])).map((n) => {
  const w = n.widgets?.find((w) => w.name === arguments[1]);
  const box = w ? (w.element.querySelector?.("textarea") ?? w.element) : null;
  const head = w?.element.querySelector?.(arguments[2]) ?? null;
  // the images the user sees: <img> elements inside a Vue node, node.imgs drawn on the classic canvas
  const el = vueNode(n.id);
  const shown = el ? [...el.querySelectorAll("img")] : (n.imgs ?? []);
  const imgs = shown.map((i) => ({src: i.src, complete: i.complete, width: i.naturalWidth}));
  return {id: String(n.id), type: n.type, text: box ? box.value : null, images: imgs,
          verdict: head ? head.textContent : null, tone: head ? head.dataset.tone : null,
          renderer: el ? "vue" : "classic", hosted: el ? !!(w && el.contains(w.element)) : null};
});
"""

_CENTER_JS = """
const node = window.app.graph.getNodeById(arguments[0]);
const canvas = window.app.canvas;
canvas.ds.scale = 1;
const rect = canvas.canvas.getBoundingClientRect();
canvas.ds.offset[0] = rect.width / 2 - node.pos[0] - node.size[0] / 2;
canvas.ds.offset[1] = Math.max(60, rect.height / 2 - node.size[1] / 2) - node.pos[1];
canvas.setDirty(true, true);
const w = node.widgets.find((w) => w.name === arguments[1]);
return w.element;
"""

_NODE_SCREEN_RECT_JS = _VUE_NODE_JS + """
const el = vueNode(arguments[0]);
if (el) {
  const r = el.getBoundingClientRect();
  return {left: r.left, top: r.top, right: r.right, bottom: r.bottom};
}
const node = window.app.graph.getNodeById(arguments[0]);
const canvas = window.app.canvas;
const rect = canvas.canvas.getBoundingClientRect();
const [x, y] = canvas.ds.convertOffsetToCanvas([node.pos[0], node.pos[1]]);
const s = canvas.ds.scale;
return {left: rect.left + x, top: rect.top + y, right: rect.left + x + node.size[0] * s,
        bottom: rect.top + y + node.size[1] * s};
"""


_COMMAND_JS = """
const done = arguments[arguments.length - 1];
Promise.resolve(window.app.extensionManager.command.execute(arguments[0]))
  .then(() => done(null), (e) => done(String(e?.message ?? e)));
"""


_TEMPLATES_BUTTON = "//button[@aria-label='Templates']"


class PageError(AssertionError):
    """The page did not reach the state a step waits for."""


class ComfyPage:
    """One browser tab on a ComfyUI server."""

    def __init__(self, driver: Any, url: str):
        self.driver = driver
        self.url = url.rstrip("/")

    # ------------------------------------------------------------------------------------ basics

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60.0, poll: float = 0.25) -> Any:
        """Poll ``check`` until it returns something truthy; raises :class:`PageError` naming ``what``."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                value = check()
                if value:
                    return value
            except (JavascriptException, StaleElementReferenceException) as e:
                last = e
            time.sleep(poll)
        raise PageError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last error: {last})" if last else ""))

    def open(self, timeout: float = 120.0) -> ComfyPage:
        """Load the app and wait until it has the pack's node definitions and its web extension."""
        self.driver.get(self.url + "/")
        self.wait(
            "the ComfyUI app with the VRAM Fit extension and node definitions",
            lambda: self.js(_READY_JS, EXTENSION, "VRAMFit_TiledVAEDecode"),
            timeout,
        )
        self.js(_RECORDER_JS)
        self.close_overlays()
        return self

    def click(self, xpath: str, what: str, timeout: float = 30.0) -> None:
        """Click the first displayed element matching ``xpath`` (a real click; retried while covered)."""

        def attempt() -> bool:
            for el in self.driver.find_elements(By.XPATH, xpath):
                if el.is_displayed():
                    try:
                        el.click()
                        return True
                    except (ElementClickInterceptedException, StaleElementReferenceException):
                        return False
            return False

        self.wait(f"a clickable {what}", attempt, timeout)

    def overlays(self) -> list[str]:
        """Texts of the dialogs and toasts on screen (missing-node warnings among them; toasts: PrimeVue's
        ``.p-toast-message`` up to 1.49, ``[data-testid=toast]`` in 1.58)."""
        return self.js(
            "return [...document.querySelectorAll('[role=dialog], .p-dialog, .p-toast-message, [data-testid=toast]')]"
            ".filter((e) => e.offsetParent !== null || e.getClientRects().length).map((e) => e.innerText)"
        )

    def close_overlays(self) -> None:
        """Close open dialogs (Escape, then their close buttons) and toasts."""
        for _ in range(3):
            if not self.overlays():
                return
            self.driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
            time.sleep(0.3)
            self.js(
                "document.querySelectorAll('.p-dialog-close-button, .p-toast-close-button, [data-testid=toast-close],"
                " [role=dialog] button[aria-label=Close]').forEach((b) => b.click())"
            )
            time.sleep(0.3)

    def screenshot(self, path: pathlib.Path) -> pathlib.Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self.driver.save_screenshot(str(path)):
            raise PageError(f"could not save a screenshot to {path}")
        return path

    # ------------------------------------------------------------------------------------ templates

    def frontend(self) -> dict:
        """``{"version": the frontend's version, "vue": whether Vue nodes are on}``."""
        return self.js(
            "return {version: window.__COMFYUI_FRONTEND_VERSION__ ?? null,"
            " vue: !!window.app.extensionManager?.setting?.get('Comfy.VueNodes.Enabled')}"
        )

    def open_template(self, name: str) -> None:
        """Templates (the sidebar button; older frontends: Workflow menu → Browse Templates) → the pack's
        folder → the template card (the real dialog)."""
        self.close_overlays()
        if self.driver.find_elements(By.XPATH, _TEMPLATES_BUTTON):
            self.click(_TEMPLATES_BUTTON, "'Templates' button of the sidebar")
        else:
            self.click("//*[contains(@class,'comfy-menu-button-wrapper')]", "ComfyUI menu button")
            self.click("//*[@role='menuitem'][normalize-space(.)='Browse Templates']", "'Browse Templates' menu item")
        self.click(f"//span[normalize-space(.)={xpath_literal(PACK_FOLDER)}]", f"'{PACK_FOLDER}' entry of the template browser")
        self.click(f"//*[@data-testid={xpath_literal('template-workflow-' + name)}]", f"template card {name}")
        self.wait(
            f"the template browser to close after choosing {name}",
            lambda: not self.driver.find_elements(By.XPATH, "//*[@data-testid='template-workflows-content']"),
        )
        self.wait(f"workflow {name!r} as the active tab, with its nodes", lambda: self._shows(name), timeout=30)

    def _shows(self, name: str) -> bool:
        """Whether the active workflow tab is template ``name`` (a second copy is ``name (2)``) with nodes."""
        graph = self.graph()
        title = graph["title"] or ""
        return bool(graph["nodes"]) and (title == name or title.startswith(f"{name} ("))

    def graph(self) -> dict:
        """``{"nodes": [{id, type, registered}], "links": n}`` of the graph on the canvas."""
        return self.js(_GRAPH_JS)

    def command(self, command_id: str) -> None:
        """Run a frontend command by its id (as its menu entry or keybinding does) and wait until it is done."""
        error = self.driver.execute_async_script(_COMMAND_JS, command_id)
        if error:
            raise PageError(f"command {command_id} failed: {error}")

    def fit_view(self) -> None:
        self.js("return window.app.extensionManager.command.execute('Comfy.Canvas.FitView')")
        time.sleep(0.5)

    # ------------------------------------------------------------------------------------ running

    def run(self, timeout: float = 300.0) -> dict:
        """Click Run and wait for the prompt to finish; returns its ``execution_success`` detail.

        Raises :class:`PageError` with ComfyUI's error text when the prompt fails or is interrupted."""
        start = self.js(_RECORDER_JS)
        self.click("//button[normalize-space(.)='Run']", "Run button")
        events = self.wait(
            "the prompt started from the Run button to finish",
            lambda: [e for e in self.js("return window.__vramfitEvents.slice(arguments[0])", start)
                     if e["type"] in _FINAL_EVENTS],
            timeout,
            poll=1.0,
        )
        end = events[0]
        detail = end.get("detail") or {}
        if end["type"] == "rejected":
            raise PageError(f"ComfyUI rejected the prompt: {detail.get('message')} {detail.get('response')}")
        if end["type"] != "execution_success":
            raise PageError(
                f"{end['type']}: node {detail.get('node_id')} ({detail.get('node_type')}): "
                f"{detail.get('exception_type')}: {detail.get('exception_message')}"
            )
        return detail

    def saved_forms(self) -> dict:
        """What the frontend would save and queue now (``app.graphToPrompt``): per node id, the
        ``widgets_values`` of the workflow and the input names of the API prompt."""
        return self.js(
            "return window.app.graphToPrompt().then(({output, workflow}) => ({"
            " widgets: Object.fromEntries(workflow.nodes.map((n) => [String(n.id), n.widgets_values ?? null])),"
            " inputs: Object.fromEntries(Object.entries(output).map(([id, n]) => [id, Object.keys(n.inputs)]))}))"
        )

    def reports(self) -> list[dict]:
        """``[{id, type, text, verdict, tone, images, renderer, hosted}]`` of every pack node: the report box's
        text, the verdict header's text and tone (``ok``/``approximate``/``over``), the images the user sees
        on the node (``<img>`` in a Vue node, ``node.imgs`` on the classic canvas), ``renderer`` (``vue`` when
        the node is a Vue node element) and ``hosted`` (Vue: the report widget is inside the node)."""
        return self.js(_REPORTS_JS, PACK_PREFIX, REPORT_WIDGET, VERDICT_SELECTOR)

    def show_report(self, node_id: str) -> tuple[Any, dict]:
        """Centre ``node_id`` at 100 % zoom; returns its report widget (a WebElement: the verdict header and
        the text box) and the node's screen rect."""
        box = self.js(_CENTER_JS, node_id, REPORT_WIDGET)
        time.sleep(0.5)  # one animation frame at least: the frontend positions DOM widgets while drawing
        return box, self.js(_NODE_SCREEN_RECT_JS, node_id)

    def shown_lines(self, widget: Any) -> tuple[Any, Any]:
        """The verdict header and the text box (WebElements) of a report widget from :meth:`show_report`."""
        head = widget.find_element(By.CSS_SELECTOR, VERDICT_SELECTOR)
        return head, widget.find_element(By.TAG_NAME, "textarea")


def xpath_literal(text: str) -> str:
    """``text`` as an XPath string literal (template names may hold quotes, commas, parentheses)."""
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text:
        return f'"{text}"'
    return "concat(" + ", \"'\", ".join(f"'{part}'" for part in text.split("'")) + ")"


def is_inside(inner: dict, outer: dict, slack: float = 2.0) -> bool:
    """Whether rect ``inner`` (selenium ``rect``: x, y, width, height) lies within ``outer`` (left/top/...)."""
    return (
        inner["x"] >= outer["left"] - slack
        and inner["y"] >= outer["top"] - slack
        and inner["x"] + inner["width"] <= outer["right"] + slack
        and inner["y"] + inner["height"] <= outer["bottom"] + slack
    )


__all__ = ["VERDICT_SELECTOR", "ComfyPage", "PageError", "WebDriverException", "is_inside"]
