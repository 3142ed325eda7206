// VRAM Fit: shows each pack node's report on the canvas after a run.
//
// The nodes return their report as `ui.text` (V3 `ui.PreviewText`). ComfyUI's frontend draws only
// `ui.images`/`gifs`/`audio`/... by itself; `ui.text` is shown only by node-specific extensions
// (`Comfy.PreviewAny` for Preview Any, `Comfy.saveText` for SaveText), so every other node needs its
// own. This one adds a read-only text box to the VRAMFit_* nodes on their first report and fills it on
// every `onExecuted` (and when the frontend restores outputs, e.g. from the queue history).
// Only public frontend API is used (`app`, `registerExtension`, `LGraphNode.addDOMWidget`), present in
// frontends 1.32 to 1.49 at least.
import { app } from "../../../scripts/app.js";

const NODE_PREFIX = "VRAMFit_";
const WIDGET_NAME = "vramfit_report";
const LINE_PX = 15; // line height of the report box (11 px monospace)
const CHAR_PX = 6.6; // width of one character at that size
const MAX_ROWS = 22; // taller reports scroll inside the box

function reportText(output) {
  const text = output?.text;
  if (text == null) return null;
  return Array.isArray(text) ? text.join("\n") : String(text);
}

function wrappedRows(text, nodeWidth) {
  const perRow = Math.max(20, Math.floor((nodeWidth - 24) / CHAR_PX));
  return text.split("\n").reduce((rows, line) => rows + Math.max(1, Math.ceil(line.length / perRow)), 0);
}

function reportWidget(node) {
  const existing = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (existing) return existing;
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
  });
  const widget = node.addDOMWidget(WIDGET_NAME, "vramfit_report", box, {
    serialize: false,
    getValue: () => box.value,
    setValue: (v) => {
      box.value = v ?? "";
    },
    getMinHeight: () => Math.min(MAX_ROWS, Math.max(4, wrappedRows(box.value, node.size[0]) + 1)) * LINE_PX,
  });
  widget.serialize = false; // not in widgets_values (saved workflows) nor in the prompt sent to ComfyUI
  return widget;
}

function showReport(node, output) {
  const text = reportText(output);
  if (text == null) return;
  const widget = reportWidget(node);
  widget.element.value = text;
  widget.value = text;
  const [w, h] = node.computeSize();
  node.setSize([Math.max(node.size[0], w), Math.max(node.size[1], h)]);
  node.setDirtyCanvas?.(true, true);
  app.graph?.setDirtyCanvas(true, true);
}

app.registerExtension({
  name: "VRAMFit.Reports",
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
