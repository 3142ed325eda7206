// VRAM Fit: "Use VRAM Fit for VAE nodes" and "Swap VRAM Fit VAE nodes back to core", one click each way.
//
// Swaps every core VAE node of the open graph (VAE Decode, VAE Decode (Tiled), VAE Encode, VAE Encode (Tiled),
// VAE Encode (for Inpainting); its subgraphs too) for the pack's node, or back. Which node becomes which and how
// widgets carry over is ../vramfit_swap.json, the file scripts/use_vramfit.py (the same swap headless, for
// API- and UI-format files) reads: keep the two in step. The new node takes the old one's id, links (the same
// link objects), title, position, size, colours, mode and place in the node list; a widget without a
// counterpart is kept in properties[stash] when swapping back needs it to give the same node again, and so is
// the node's size (a swap back restores it).
// Commands (bindable to keys): VRAMFit.UseForVAENodes, VRAMFit.RevertVAENodes; also in the Extensions menu,
// the canvas menu and a VAE node's context menu. Public frontend API only (app, registerExtension with
// commands/menuCommands/getCanvasMenuItems/getNodeMenuItems, LiteGraph nodes), present in frontends 1.32-1.49.
import { app } from "../../../scripts/app.js";

const MAPPING_URL = new URL("../vramfit_swap.json", import.meta.url);
const USE_ID = "VRAMFit.UseForVAENodes";
const REVERT_ID = "VRAMFit.RevertVAENodes";
const USE_LABEL = "Use VRAM Fit for VAE nodes";
const REVERT_LABEL = "Swap VRAM Fit VAE nodes back to core";
const ORIGIN_PROPERTIES = ["cnr_id", "ver", "aux_id"];

let mapping = null;
async function loadMapping() {
  if (!mapping) {
    const res = await fetch(MAPPING_URL);
    if (!res.ok) throw new Error(`VRAM Fit: could not load ${MAPPING_URL} (${res.status})`);
    mapping = await res.json();
  }
  return mapping;
}

// ------------------------------------------------------------------ the mapping (as scripts/use_vramfit.py)

const spec = (m, type) => m.nodes[type];
const widgetNames = (m, type) => spec(m, type).widgets.map((w) => w.name);
const defaults = (m, type) => Object.fromEntries(spec(m, type).widgets.map((w) => [w.name, w.default]));
const isCore = (m, type) => m.swap.some((e) => e.core === type);
const sources = (m, revert) => new Set(revert ? Object.keys(m.revert) : m.swap.map((e) => e.core));
const entryOf = (m, core, pack) => m.swap.find((e) => e.core === core && e.pack === pack) ?? null;
const pick = (m, core, kind) => m.swap.find((e) => e.core === core && (e.kind === kind || e.kind === "any"));
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);

function clamp(value, s) {
  const lo = s.min, hi = s.max, step = s.step || 1;
  if (lo != null && value < lo) value = lo;
  if (hi != null && value > hi) value = hi;
  const base = lo != null && lo > 0 ? lo : 0;
  return value - ((value - base) % step);
}

// `kind`: {kind: "video"|"image", temporal: the VAE's temporal compression, why} (kindOf below)
function mapValue(rule, value, toPack, targetSpec, kind) {
  const [srcAuto, dstAuto] = toPack ? ["core_auto", "pack_auto"] : ["pack_auto", "core_auto"];
  if (srcAuto in rule && value === rule[srcAuto]) return rule[dstAuto];
  if (!Number.isInteger(value)) return value;
  const divide = rule.divide === "temporal_compression" ? kind.temporal : (rule.divide ?? 1);
  let scaled = toPack ? Math.floor(value / divide) : value * divide;
  if (toPack && value > 0) scaled = Math.max(scaled, 1);
  return clamp(scaled, targetSpec);
}

const widgetSpec = (m, type, name) => spec(m, type).widgets.find((w) => w.name === name);

function convertOnce(m, x, kind, useStash = true) {
  const toPack = isCore(m, x.type);
  let stash = useStash ? x.stash : null;
  let entry = null;
  if (stash) entry = toPack ? entryOf(m, x.type, stash.type) : entryOf(m, stash.type, x.type);
  if (!entry) {
    stash = null;
    entry = toPack ? pick(m, x.type, kind.kind) : entryOf(m, m.revert[x.type], x.type);
  }
  const yType = toPack ? entry.pack : entry.core;
  const y = defaults(m, yType);
  if (stash) for (const [k, v] of Object.entries(stash.widgets ?? {})) if (k in y) y[k] = v;
  for (const rule of entry.widgets) {
    const [xn, yn] = toPack ? [rule.core, rule.pack] : [rule.pack, rule.core];
    if (!(xn in x.widgets)) continue;
    if (stash && yn in (stash.widgets ?? {})) {
      const back = mapValue(rule, stash.widgets[yn], !toPack, widgetSpec(m, x.type, xn), kind);
      if (same(back, x.widgets[xn])) continue;
    }
    y[yn] = mapValue(rule, x.widgets[xn], toPack, widgetSpec(m, yType, yn), kind);
  }
  return { type: yType, widgets: y, entry };
}

function autoTitle(m, x, yType) {
  if (x.title == null) return null;
  if (x.title === x.type || x.title === spec(m, x.type).display_name) {
    return isCore(m, yType) ? yType : spec(m, yType).display_name;
  }
  return x.title;
}

function convert(m, x, kind) {
  const { type, widgets, entry } = convertOnce(m, x, kind);
  const title = x.stash && "title" in x.stash && x.stash.type === type ? x.stash.title : autoTitle(m, x, type);
  const y = { type, widgets, title, stash: null };
  const back = convertOnce(m, y, kind, false);
  if (back.type !== x.type || !same(back.widgets, x.widgets) || autoTitle(m, y, back.type) !== x.title) {
    y.stash = { type: x.type, widgets: { ...x.widgets }, title: x.title };
  }
  const side = isCore(m, x.type) ? "core" : "pack";
  const mapped = new Set(entry.widgets.map((r) => r[side]));
  const kept = Object.fromEntries(Object.entries(x.widgets).filter(([k]) => !mapped.has(k)));
  return { y, kept };
}

// ------------------------------------------------------------------ the graph

function graphsOf(root) {
  const subs = root.subgraphs ? [...(root.subgraphs.values?.() ?? Object.values(root.subgraphs))] : [];
  return [root, ...subs];
}
const nodesOf = (graph) => graph.nodes ?? graph._nodes ?? [];

// ------------------------------------------------------------------ video hints (as scripts/use_vramfit.py)

// The links of the serialized workflow as one graph, through subgraph boundaries (scripts/use_vramfit.py
// ui_flow): keys JSON [graph id (null: the root graph), node id as a string (frontends 1.4x give live nodes
// string ids, their serialization numbers)], or [graph id, "in"|"out", slot] for a
// subgraph's input and output slots; a link into a subgraph node goes to the subgraph's input slot, on to the
// nodes inside its definition, one out of it comes from the definition's output slot.
const keyOf = (...parts) => JSON.stringify(parts);

function linkEnds(graph) {
  return (graph.links ?? []).filter(Boolean).map((l) =>
    Array.isArray(l) ? [l[1], l[2], l[3], l[4]] : [l.origin_id, l.origin_slot, l.target_id, l.target_slot]);
}

function subgraphSlot(node, side, slot, names) {
  const entries = node[side] ?? [];
  const name = Number.isInteger(slot) && slot >= 0 && slot < entries.length ? entries[slot]?.name : undefined;
  const k = name === undefined ? -1 : names.indexOf(name);
  return k >= 0 ? k : slot;
}

function flowOf(workflow) {
  const flow = { types: new Map(), values: new Map(), ups: new Map(), downs: new Map() };
  const subs = new Map((workflow.definitions?.subgraphs ?? []).map((s) => [s.id, s]));
  const names = (list) => (list ?? []).map((e) => e?.name);
  const link = (src, dst, name) => {
    if (!flow.ups.has(dst)) flow.ups.set(dst, []);
    if (!flow.downs.has(src)) flow.downs.set(src, new Set());
    flow.ups.get(dst).push([name, src]);
    flow.downs.get(src).add(dst);
  };
  for (const [gid, graph] of [[null, workflow], ...subs.entries()]) {
    const nodes = new Map((graph.nodes ?? []).map((n) => [String(n.id), n]));
    for (const [id, n] of nodes) {
      flow.types.set(keyOf(gid, id), n.type);
      flow.values.set(keyOf(gid, id), Array.isArray(n.widgets_values) ? n.widgets_values : []);
    }
    for (const [origin, oSlot, target, tSlot] of linkEnds(graph)) {
      let src = keyOf(gid, String(origin));
      let dst = keyOf(gid, String(target));
      let name = null;
      const from = nodes.get(String(origin));
      const to = nodes.get(String(target));
      if (String(origin) === "-10") src = keyOf(gid, "in", oSlot);
      else if (from && subs.has(from.type)) {
        src = keyOf(from.type, "out", subgraphSlot(from, "outputs", oSlot, names(subs.get(from.type).outputs)));
      }
      if (String(target) === "-20") dst = keyOf(gid, "out", tSlot);
      else if (to && subs.has(to.type)) {
        dst = keyOf(to.type, "in", subgraphSlot(to, "inputs", tSlot, names(subs.get(to.type).inputs)));
      } else {
        const entries = to?.inputs ?? [];
        name = Number.isInteger(tSlot) && tSlot >= 0 && tSlot < entries.length ? entries[tSlot]?.name ?? null : null;
      }
      link(src, dst, name);
    }
  }
  return flow;
}

function closure(flow, starts, down = false) {
  const seen = new Set(starts);
  const todo = [...starts];
  while (todo.length) {
    const key = todo.pop();
    const nexts = down ? [...(flow.downs.get(key) ?? [])] : (flow.ups.get(key) ?? []).map(([, o]) => o);
    for (const next of nexts) {
      if (seen.has(next)) continue;
      seen.add(next);
      todo.push(next);
    }
  }
  return seen;
}

// {kind, temporal, why} of core node `type` at `key` (scripts/use_vramfit.py kind_of): its VAE's file, a node
// making video latents or frames upstream, or (a decode whose VAE file is not seen) a video node downstream.
function kindOf(m, flow, key, type) {
  const video = m.video;
  const upstream = new Set(video.upstream);
  const downstream = new Set(video.downstream);
  const loaders = new Set(video.vae_loaders ?? []);
  const families = video.families ?? {};
  const vaeFrom = (flow.ups.get(key) ?? []).filter(([name]) => name === "vae").map(([, o]) => o);
  const files = new Set();
  for (const k of closure(flow, vaeFrom)) {
    if (!loaders.has(flow.types.get(k))) continue;
    for (const v of flow.values.get(k) ?? []) if (typeof v === "string") files.add(v);
  }
  const sortedFiles = [...files].sort();
  let seen = null;
  for (const rule of video.vae_files ?? []) {
    const file = sortedFiles.find((f) => new RegExp(rule.match, "i").test(f));
    if (file !== undefined) {
      seen = [file, rule.family];
      break;
    }
  }
  const above = new Set();
  for (const k of closure(flow, [key])) {
    if (k !== key && upstream.has(flow.types.get(k))) above.add(flow.types.get(k));
  }
  const aboveSorted = [...above].sort();
  const family = seen ? seen[1]
    : Object.keys(families).find((f) => (families[f].upstream ?? []).some((t) => above.has(t))) ?? null;
  const temporal = families[family]?.temporal_compression ?? video.temporal_compression ?? 4;
  if (seen) return { kind: "video", temporal, why: `video: VAE ${seen[0]}` };
  if (aboveSorted.length) return { kind: "video", temporal, why: `video: from ${aboveSorted[0]}` };
  const decode = spec(m, type).inputs[0]?.[1] === "LATENT";
  if (decode && !files.size) {
    const below = [...closure(flow, [key], true)].map((k) => flow.types.get(k)).filter((t) => downstream.has(t));
    if (below.length) return { kind: "video", temporal, why: `video: into ${below.sort()[0]}` };
  }
  return { kind: "image", temporal, why: "" };
}

const classTitle = (type) => LiteGraph.registered_node_types[type]?.title ?? type;

function readState(m, node) {
  const widgets = {};
  const defs = defaults(m, node.type);
  for (const name of widgetNames(m, node.type)) {
    const w = node.widgets?.find((w) => w.name === name);
    widgets[name] = w ? w.value : defs[name];
  }
  const title = node.title && node.title !== classTitle(node.type) ? node.title : null;
  return { type: node.type, widgets, title, stash: node.properties?.[m.stash] ?? null };
}

// Why `node` cannot be swapped (null when it can).
function blocker(m, node, revert) {
  const driven = (node.inputs ?? []).find((i) => i.widget && i.link != null);
  if (driven) return `widget '${driven.widget.name ?? driven.name}' is driven by a link`;
  if (revert && (node.outputs ?? []).slice(1).some((o) => o.links?.length)) {
    return "its report output is linked (the core node has none)";
  }
  const sockets = spec(m, node.type).inputs.length;
  const bad = (node.inputs ?? []).slice(0, sockets).some((i, k) => i.name !== spec(m, node.type).inputs[k][0]);
  return bad ? "its inputs are not the ones the mapping knows" : null;
}

function replace(m, graph, old, x, y) {
  const list = nodesOf(graph);
  const index = list.indexOf(old);
  const sockets = spec(m, old.type).inputs.length;
  const inLinks = (old.inputs ?? []).slice(0, sockets).map((i) => i.link ?? null);
  const outLinks = (old.outputs ?? []).map((o) => o.links ?? null);
  const outSlots = (old.outputs ?? []).map((o) => ("slot_index" in o ? [o.slot_index] : null)); // a loaded file's
  const keep = {
    id: old.id, pos: [...old.pos], size: [...old.size], color: old.color, bgcolor: old.bgcolor,
    mode: old.mode, shape: old.shape, flags: { ...(old.flags ?? {}) }, properties: { ...(old.properties ?? {}) },
  };
  // the links stay: detach them from the old node so that removing it leaves them in the graph
  for (const input of old.inputs ?? []) input.link = null;
  for (const output of old.outputs ?? []) output.links = [];
  graph.remove(old);
  const node = LiteGraph.createNode(y.type);
  if (!node) throw new Error(`VRAM Fit: node type ${y.type} is not registered`);
  node.id = keep.id;
  // before add: Vue nodes take the position, title and widget values a node is added with
  node.pos = [...keep.pos];
  for (const w of node.widgets ?? []) if (w.name in y.widgets) w.value = y.widgets[w.name];
  if (y.title != null) node.title = y.title;
  graph.add(node);
  if (node.id !== keep.id) throw new Error(`VRAM Fit: could not keep node id ${keep.id}`);
  // and after: frontends 1.4x keep widget values by node id and widget name, so a widget the old node had too
  // (tile_size) came back with the old node's value on add
  for (const w of node.widgets ?? []) if (w.name in y.widgets && !same(w.value, y.widgets[w.name])) w.value = y.widgets[w.name];
  for (let k = 0; k < inLinks.length && k < (node.inputs?.length ?? 0); k++) node.inputs[k].link = inLinks[k];
  if (node.outputs?.length && outLinks[0]) node.outputs[0].links = outLinks[0];
  for (let k = 0; k < outSlots.length && k < (node.outputs?.length ?? 0); k++) {
    if (outSlots[k]) node.outputs[k].slot_index = outSlots[k][0]; // null stays null (scripts/use_vramfit.py too)
  }
  node.pos = keep.pos;
  const fits = node.computeSize?.() ?? keep.size;
  const grown = [Math.max(keep.size[0], fits[0]), Math.max(keep.size[1], fits[1])];
  const returning = x.stash?.type === y.type; // back to what the node was: its size then, not a grown one
  node.size = returning ? [...(x.stash.size ?? keep.size)] : grown;
  for (const key of ["color", "bgcolor", "shape"]) if (keep[key] !== undefined) node[key] = keep[key];
  node.mode = keep.mode;
  node.flags = keep.flags;
  let props = { ...node.properties };
  for (const [k, v] of Object.entries(keep.properties)) {
    if (k !== m.stash && !ORIGIN_PROPERTIES.includes(k)) props[k] = v;
  }
  if (props["Node name for S&R"] === x.type) props["Node name for S&R"] = y.type;
  if (returning) {
    Object.assign(props, x.stash.properties ?? {});
    const order = (x.stash.order ?? []).filter((k) => k in props); // where the registry fields were
    props = { ...Object.fromEntries(order.map((k) => [k, props[k]])), ...props };
  }
  let stash = y.stash;
  const origin = Object.fromEntries(ORIGIN_PROPERTIES.filter((k) => k in keep.properties).map((k) => [k, keep.properties[k]]));
  if (Object.keys(origin).length) {
    stash = { ...(stash ?? { type: x.type, widgets: { ...x.widgets }, title: x.title }), properties: origin };
    const order = Object.keys(keep.properties).filter((k) => k !== m.stash);
    const last = [...order.filter((k) => !(k in origin)), ...Object.keys(origin)];
    if (!same(order, last)) stash.order = order;
  }
  // the size it had (a run may grow a pack node by its report): swapping back gives the node that size again
  if (!returning) stash = { ...(stash ?? { type: x.type, widgets: { ...x.widgets }, title: x.title }), size: keep.size };
  delete props[m.stash];
  if (stash) props[m.stash] = stash;
  node.properties = props;
  // back to the old node's place in the list (the execution order and the saved file keep their order)
  const now = list.indexOf(node);
  if (index >= 0 && now >= 0 && now !== index) {
    list.splice(now, 1);
    list.splice(index, 0, node);
  }
  return node;
}

// Swaps the matching nodes of the open graph (those `only` accepts); returns {swaps, skipped, left}: left, the
// VAE nodes with no VRAM Fit counterpart (mapping's "unmapped": audio, 3-D), {type: {count, why}}.
export async function swapGraph(revert = false, only = null) {
  const m = await loadMapping();
  const wanted = sources(m, revert);
  const unmapped = m.unmapped ?? {};
  const swaps = [];
  const skipped = [];
  const left = {};
  const flow = flowOf(app.graph.serialize()); // of the graph as it is now: every node's kind from the same graph
  for (const graph of graphsOf(app.graph)) {
    const gid = graph === app.graph ? null : graph.id;
    for (const old of [...nodesOf(graph)]) {
      if (only && !only(old)) continue;
      if (!revert && Object.hasOwn(unmapped, old.type)) {
        left[old.type] = { count: (left[old.type]?.count ?? 0) + 1, why: unmapped[old.type] };
      }
      if (!wanted.has(old.type)) continue;
      const why = blocker(m, old, revert);
      if (why) {
        skipped.push({ id: old.id, type: old.type, why });
        continue;
      }
      const x = readState(m, old);
      const kind = kindOf(m, flow, keyOf(gid, String(old.id)), old.type);
      const { y, kept } = convert(m, x, kind);
      replace(m, graph, old, x, y);
      swaps.push({ id: old.id, from: x.type, to: y.type, kept, why: revert ? "" : kind.why });
    }
    graph.updateExecutionOrder?.();
  }
  app.graph.setDirtyCanvas?.(true, true);
  app.canvas?.setDirty?.(true, true);
  app.extensionManager?.workflow?.activeWorkflow?.changeTracker?.checkState?.();
  return { swaps, skipped, left };
}

function summary(result, revert) {
  const { swaps, skipped } = result;
  const lines = [
    revert
      ? `${swaps.length} VRAM Fit VAE node(s) swapped back to core nodes.`
      : `${swaps.length} VAE node(s) now use VRAM Fit.`,
  ];
  const dropped = swaps.filter((s) => Object.keys(s.kept).length);
  if (dropped.length) {
    lines.push(
      (revert ? "VRAM Fit-only" : "Core-only") + " widgets dropped (kept on the node for swapping back): " +
        dropped.map((s) => `#${s.id} ${s.from}: ${Object.entries(s.kept).map(([k, v]) => `${k}=${v}`).join(", ")}`)
          .join("; "),
    );
  }
  for (const s of skipped) lines.push(`Left #${s.id} ${s.type}: ${s.why}.`);
  for (const [type, { count, why }] of Object.entries(result.left ?? {})) {
    lines.push(`Left ${count} ${type} node(s) as they are (no VRAM Fit counterpart): ${why}.`);
  }
  return lines.join("\n");
}

function toast(text, ok) {
  const toasts = app.extensionManager?.toast;
  if (toasts?.add) toasts.add({ severity: ok ? "success" : "warn", summary: "VRAM Fit", detail: text, life: 8000 });
  else console.info(text);
}

async function run(revert, only = null) {
  try {
    const result = await swapGraph(revert, only);
    toast(summary(result, revert), !result.skipped.length);
    return result;
  } catch (e) {
    toast(`VRAM Fit: the swap failed: ${e?.message ?? e}`, false);
    throw e;
  }
}

function chosen(node) {
  const selected = Object.values(app.canvas?.selected_nodes ?? {});
  const ids = new Set((selected.includes(node) ? selected : [node]).map((n) => n.id));
  return (n) => ids.has(n.id);
}

app.registerExtension({
  name: "VRAMFit.Swap",
  commands: [
    { id: USE_ID, label: USE_LABEL, icon: "pi pi-sync", function: () => run(false) },
    { id: REVERT_ID, label: REVERT_LABEL, icon: "pi pi-undo", function: () => run(true) },
  ],
  menuCommands: [{ path: ["Extensions", "VRAM Fit"], commands: [USE_ID, REVERT_ID] }],
  async setup() {
    await loadMapping().catch((e) => console.warn(e));
  },
  getCanvasMenuItems() {
    return [null, { content: USE_LABEL, callback: () => run(false) }, { content: REVERT_LABEL, callback: () => run(true) }];
  },
  getNodeMenuItems(node) {
    if (!mapping) return [];
    if (sources(mapping, false).has(node.type)) {
      return [{ content: "Use VRAM Fit for this VAE node", callback: () => run(false, chosen(node)) }];
    }
    if (sources(mapping, true).has(node.type)) {
      return [{ content: "Swap back to the core VAE node", callback: () => run(true, chosen(node)) }];
    }
    return [];
  },
});
