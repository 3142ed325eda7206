// VRAM Fit: shows each pack node's report on the canvas after a run.
//
// The nodes return their report as `ui.text` (V3 `ui.PreviewText`). ComfyUI's frontend draws only
// `ui.images`/`gifs`/`audio`/... by itself; `ui.text` is shown only by node-specific extensions
// (`Comfy.PreviewAny` for Preview Any, `Comfy.saveText` for SaveText), so every other node needs its
// own. This one adds a read-only report widget to the VRAMFit_* nodes on their first report and fills it
// on every `onExecuted` (and when the frontend restores outputs, e.g. from the queue history): the
// report's one-line verdict (memory/report.py: the unindented line under the title) as a bold header,
// red when it says OVER BUDGET, amber when approximate, then the whole report in a text box.
// While a decode does once-per-VAE work (self-check, calibration) the header shows that phase, sent by the
// node as the `vramfit.phase` websocket event (nodes/_comfy.py `progress_text`).
// Both node renderers: the classic canvas (LiteGraph draws the node, the widget is a DOM overlay sized by
// getMinHeight) and Vue nodes ("Nodes 2.0", `Comfy.VueNodes.Enabled`: the node is a DOM element `.lg-node` that
// hosts the widget in its own layout; there the report keeps its height by a CSS min-height). Where a Vue
// node does not host the widget (or a frontend has no DOM widgets), the verdict goes to a toast instead.
// Only public frontend API is used (`app`, `api`, `registerExtension`, `LGraphNode.addDOMWidget`,
// `extensionManager.toast`), present in frontends 1.28 to 1.58 at least.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

const NODE_PREFIX = "VRAMFit_";
const WIDGET_NAME = "vramfit_report";
const LINE_PX = 15; // line height of the report box (11 px monospace)
const CHAR_PX = 6.6; // width of one character at that size
const MAX_ROWS = 22; // taller reports scroll inside the box (the verdict included)
const HEAD_LINE_PX = 16; // line height of the verdict (12 px bold monospace)
const HEAD_CHAR_PX = 7.3;
const HEAD_PAD_PX = 6; // its vertical padding and the gap below it
const TONES = {
  over: { color: "#ffd7d7", background: "rgba(200, 40, 40, 0.55)" },
  approximate: { color: "#ffe8b0", background: "rgba(190, 130, 20, 0.45)" },
  ok: { color: "#d4f5d4", background: "rgba(40, 140, 60, 0.40)" },
  phase: { color: "#d6e6ff", background: "rgba(40, 90, 190, 0.45)" },
};
const PHASE_EVENT = "vramfit.phase";
const HOST_CHECK_MS = 1000; // a Vue node mounts a new widget on a later tick: look for it after this
const TOAST_MS = 12000;
const SEVERITY = { over: "error", approximate: "warn", ok: "success" };
const toasted = new WeakMap(); // node -> the report whose verdict went to a toast (once per report)

// Vue nodes hold the widget inside the node's element, whose height follows its content: without this the
// report box shrinks to two rows there. The classic canvas has no .lg-node and sizes by getMinHeight.
function addStyle() {
  const style = document.createElement("style");
  style.dataset.vramfit = "reports";
  style.textContent = ".lg-node .vramfit-report-wrap { min-height: var(--vramfit-min-height, 0px); }";
  document.head.append(style);
}

function reportText(output) {
  const text = output?.text;
  if (text == null) return null;
  return Array.isArray(text) ? text.join("\n") : String(text);
}

function wrappedRows(text, nodeWidth, charPx = CHAR_PX) {
  const perRow = Math.max(20, Math.floor((nodeWidth - 24) / charPx));
  return text.split("\n").reduce((rows, line) => rows + Math.max(1, Math.ceil(line.length / perRow)), 0);
}

// The verdict: the unindented line right under the report's title ("" for a report without one).
function verdictLine(text) {
  const line = String(text ?? "").split("\n")[1] ?? "";
  return line.trim() && !line.startsWith(" ") ? line : "";
}

function tone(verdict) {
  if (/OVER BUDGET/.test(verdict)) return "over";
  return /^approximate\b/.test(verdict) ? "approximate" : "ok";
}

function setReport(wrap, text) {
  const head = wrap.querySelector(".vramfit-verdict");
  const box = wrap.querySelector("textarea");
  const verdict = verdictLine(text);
  head.textContent = verdict;
  head.style.display = verdict ? "block" : "none";
  head.dataset.tone = verdict ? tone(verdict) : "";
  Object.assign(head.style, TONES[tone(verdict)]);
  box.value = text ?? "";
}

function minHeight(wrap, nodeWidth) {
  const head = wrap.querySelector(".vramfit-verdict").textContent;
  const headPx = head ? wrappedRows(head, nodeWidth, HEAD_CHAR_PX) * HEAD_LINE_PX + HEAD_PAD_PX : 0;
  const rows = Math.max(4, wrappedRows(wrap.querySelector("textarea").value, nodeWidth) + 1);
  return Math.min(MAX_ROWS * LINE_PX, headPx + rows * LINE_PX);
}

function reportWidget(node) {
  const existing = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (existing) return existing;
  if (typeof node.addDOMWidget !== "function") return null;
  const wrap = document.createElement("div");
  wrap.className = "vramfit-report-wrap";
  wrap.dataset.vramfitNode = String(node.id);
  Object.assign(wrap.style, {
    display: "flex",
    flexDirection: "column",
    gap: "2px",
    width: "100%",
    height: "100%",
    boxSizing: "border-box",
  });
  const head = document.createElement("div");
  head.className = "vramfit-verdict";
  head.title = "VRAM Fit verdict (the report's first line under its title)";
  Object.assign(head.style, {
    fontFamily: "monospace",
    fontSize: "12px",
    fontWeight: "bold",
    lineHeight: `${HEAD_LINE_PX}px`,
    padding: "2px 6px",
    borderRadius: "4px",
    whiteSpace: "pre-wrap",
    overflowWrap: "anywhere",
    flex: "0 0 auto",
  });
  const box = document.createElement("textarea");
  box.className = "comfy-multiline-input vramfit-report";
  box.readOnly = true;
  box.spellcheck = false;
  box.dataset.vramfitNode = String(node.id);
  Object.assign(box.style, {
    fontFamily: "monospace",
    fontSize: "11px",
    lineHeight: `${LINE_PX}px`,
    whiteSpace: "pre-wrap", // the node keeps its width; long rows wrap instead of hiding to the right
    overflowY: "auto",
    flex: "1 1 auto",
    minHeight: "0",
  });
  wrap.append(head, box);
  setReport(wrap, "");
  const widget = node.addDOMWidget(WIDGET_NAME, "vramfit_report", wrap, {
    serialize: false,
    getValue: () => box.value,
    setValue: (v) => setReport(wrap, v),
    getMinHeight: () => minHeight(wrap, node.size[0]),
  });
  widget.serialize = false; // not in widgets_values (saved workflows) nor in the prompt sent to ComfyUI
  return widget;
}

function fit(node, wrap) {
  wrap.style.setProperty("--vramfit-min-height", `${minHeight(wrap, node.size[0])}px`);
  const [w, h] = node.computeSize();
  node.setSize([Math.max(node.size[0], w), Math.max(node.size[1], h)]);
  node.setDirtyCanvas?.(true, true);
  app.graph?.setDirtyCanvas(true, true);
}

// A phase of a running decode ("first use of this VAE: checking exactness ..."), until its report arrives.
function showPhase(node, text) {
  const widget = reportWidget(node);
  if (!widget) return;
  const head = widget.element.querySelector(".vramfit-verdict");
  head.textContent = String(text ?? "");
  head.style.display = text ? "block" : "none";
  head.dataset.tone = "phase";
  Object.assign(head.style, TONES.phase);
  fit(node, widget.element);
}

// The node's element when Vue nodes draw it (null on the classic canvas, or while Vue has not drawn it).
function vueNodeElement(node) {
  return document.querySelector(`.lg-node[data-node-id="${CSS.escape(String(node.id))}"]`);
}

// The verdict as a toast: for a report the node cannot show (no DOM widget, or a Vue node without it).
function toastVerdict(node, text) {
  if (toasted.get(node) === text) return;
  const verdict = verdictLine(text) || String(text).split("\n")[0];
  const toast = app.extensionManager?.toast;
  if (!verdict || typeof toast?.add !== "function") return;
  toasted.set(node, text);
  toast.add({
    severity: SEVERITY[tone(verdict)],
    summary: `${node.title ?? node.type} (#${node.id})`,
    detail: verdict,
    life: TOAST_MS,
  });
}

function showReport(node, output) {
  const text = reportText(output);
  if (text == null) return;
  const widget = reportWidget(node);
  if (!widget) {
    toastVerdict(node, text);
    return;
  }
  setReport(widget.element, text);
  widget.value = text;
  fit(node, widget.element);
  setTimeout(() => {
    const host = vueNodeElement(node);
    if (host && !host.contains(widget.element)) toastVerdict(node, text);
  }, HOST_CHECK_MS);
}

app.registerExtension({
  name: "VRAMFit.Reports",
  setup() {
    addStyle();
    api.addEventListener(PHASE_EVENT, ({ detail }) => {
      const node = app.graph?.getNodeById(detail?.node);
      if ((node?.comfyClass ?? node?.type)?.startsWith(NODE_PREFIX)) showPhase(node, detail.text);
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith(NODE_PREFIX)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      const result = onExecuted?.apply(this, arguments);
      showReport(this, output);
      return result;
    };
  },
  onNodeOutputsUpdated(nodeOutputs) {
    for (const [id, output] of Object.entries(nodeOutputs ?? {})) {
      const node = app.graph?.getNodeById(id);
      if ((node?.comfyClass ?? node?.type)?.startsWith(NODE_PREFIX)) showReport(node, output);
    }
  },
});
