"""The pack in a real browser (issue 13): templates load from the template browser, the CPU templates run
from the Run button, and every pack node shows its report on the canvas (VRAM Monitor: with its plot),
its one-line verdict first, in a header above the report box (issue 22); on the host's own frontend and the
newest one, with the classic canvas and with Vue nodes (issue 37; the demo template, the others on the
host's frontend and the classic canvas); where a Vue node does not host the report, a toast gives the verdict.

Screenshots: ``outputs/browser/<ComfyUI version>/<template>_loaded.png``, ``<template>_<frontend version>_
<renderer>_run.png`` (whole graph) and ``..._<node id>_report.png`` (each pack node at 100 %); see
tests/browser/conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request

import pytest
from vramfit.memory.report import Report

from scripts.host import ROOT
from scripts.workflow_graphs import CPU_TEMPLATES
from tests.browser.comfy_page import PACK_PREFIX, REPORT_WIDGET, PageError, is_inside
from tests.browser.conftest import RENDERERS

pytestmark = pytest.mark.server

WORKFLOWS_DIR = ROOT / "workflows"
TEMPLATES = sorted(p.stem for p in WORKFLOWS_DIR.glob("*.json"))
FRONTEND_ONLY_TYPES = {"MarkdownNote", "Note", "Reroute", "PrimitiveNode"}
"""Node types the frontend defines itself (never in /object_info)."""
DEMO = CPU_TEMPLATES[0]
"""The tiled demo: every kind of pack node (encode, decode, inpaint encode, offload, VRAM Monitor's plot)."""
RUNS = [(DEMO, "pinned", "classic")] + [
    pytest.param(name, "pinned", "classic", marks=pytest.mark.slow) for name in CPU_TEMPLATES if name != DEMO] + [
    (DEMO, frontend, renderer) for frontend, renderer in (("pinned", "vue"), ("newest", "classic"), ("newest", "vue"))
]
"""(template, frontend, renderer) of the run test, in the order that starts one server per frontend; a user's default
run runs the demo (every kind of pack node) on the host's own canvas, the other CPU templates are the slow tier."""
MIN_BOX_PX = 55
"""The report box keeps at least about 4 rows of text (web/js/vramfit.js: 15 px rows) on the node."""

# Report title and the rows each pack node's report must show on the node (memory/report.py format).
REPORTS = {
    "VRAMFit_TiledVAEDecode": ("Tiled VAE Decode", ("path", "budget", "plan", "predicted", "measured", "time")),
    "VRAMFit_TiledVAEEncode": ("Tiled VAE Encode", ("path", "budget", "plan", "predicted", "measured", "time")),
    "VRAMFit_TemporalChunkVideoDecode": (
        "Temporal-Chunk Video Decode",
        ("path", "budget", "plan", "predicted", "measured", "time"),
    ),
    "VRAMFit_VAEEncodeForInpaint": (
        "VAE Encode for Inpaint",
        ("path", "budget", "plan", "predicted", "measured", "time"),
    ),
    "VRAMFit_TemporalChunkVideoEncode": (
        "Temporal-Chunk Video Encode",
        ("path", "budget", "plan", "predicted", "measured", "time"),
    ),
    "VRAMFit_OffloadManager": ("Offload Manager", ("request", "before", "unloaded", "freed", "after", "time")),
    "VRAMFit_Bf16Loader": ("bf16 Loader", ("file", "before", "dtype", "after")),
    "VRAMFit_VRAMMonitor": ("VRAM Monitor", ("allocated", "peak", "timeline")),
}
_BYTES = r"[\d.,]+ (?:B|KiB|MiB|GiB)"
_TIME = r"[\d.]+ m?s"
VERDICTS = {
    # path word, tiles or chunks, measured peak (named: RSS, tensor, allocated) vs the budget, time
    "decode": re.compile(rf"^(exact|approximate) · [^·]+ · (RSS |tensor |allocated )?peak {_BYTES} (of|>) "
                         rf"{_BYTES} tensor budget(: OVER BUDGET)?( · [^·]+)? · {_TIME}( · .+)?$"),
    "VRAMFit_OffloadManager": re.compile(rf"^(freed {_BYTES} · unloaded \d+ of \d+ models?|nothing unloaded "
                                         rf".+)( · kept .+)?( · drop at prompt end)? · {_TIME}$"),
    "VRAMFit_Bf16Loader": re.compile(rf"^\w+ · {_BYTES} loaded, \d+% of the file's {_BYTES} · .+$"),
    "VRAMFit_VRAMMonitor": re.compile(rf"^#\d+ .+ · (RSS |allocated )?peak ({_BYTES}|-)"
                                      rf"( · allocated {_BYTES})?"),
}
"""The one-line verdict each pack node shows first (memory/report.py ``Report.summary``)."""


def _template(name: str) -> dict:
    return json.loads((WORKFLOWS_DIR / f"{name}.json").read_text())


def _file_part(name: str) -> str:
    """``name`` made safe for a screenshot's file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def _settled(reports: list[dict]) -> bool:
    """Every pack node shows a report and every VRAM Monitor's plot image has loaded."""
    plots = [r["images"] for r in reports if r["type"] == "VRAMFit_VRAMMonitor"]
    return all(r["text"] for r in reports) and all(p and all(i["complete"] and i["width"] for i in p) for p in plots)


def _has_row(text: str, key: str) -> bool:
    return re.search(rf"^  {re.escape(key)}\s* : +\S", text, re.M) is not None


def test_pack_extension_is_served(ui_server):
    """ComfyUI lists the pack's web extension (``WEB_DIRECTORY``) and serves it."""
    client = ui_server.client()
    listed = client.get("/extensions")
    url = f"/extensions/{ui_server.cfg.pack_dir.name}/js/vramfit.js"
    assert url in listed
    with urllib.request.urlopen(ui_server.url + url, timeout=30) as resp:
        assert b"registerExtension" in resp.read()


@pytest.mark.parametrize("name", [n if n in CPU_TEMPLATES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in TEMPLATES])
def test_template_loads_from_the_template_browser(page, ui_server, shots_dir, name):
    """Workflow menu → Browse Templates → ComfyUI-VRAM-Fit → the template: the canvas holds the JSON's
    nodes and links, every pack node is known to the frontend, and no missing-node warning names a pack
    node (templates needing third-party packs warn about exactly those packs' nodes; the missing-models
    warning of the templates whose models are not installed is fine)."""
    ui = _template(name)
    page.open_template(name)
    graph = page.graph()
    page.fit_view()
    page.screenshot(shots_dir / f"{_file_part(name)}_loaded.png")
    warnings = page.overlays()

    assert len(graph["nodes"]) == len(ui["nodes"])
    assert graph["links"] == len(ui["links"])
    assert sorted(n["type"] for n in graph["nodes"]) == sorted(n["type"] for n in ui["nodes"])
    known = set(ui_server.client().object_info()) | FRONTEND_ONLY_TYPES
    missing = {n["type"] for n in graph["nodes"] if not n["registered"]}
    assert missing == {n["type"] for n in ui["nodes"] if n["type"] not in known}
    assert not any(t.startswith(PACK_PREFIX) for t in missing)
    assert not [w for w in warnings if PACK_PREFIX in w]
    if not missing:
        assert not [w for w in warnings if re.search(r"missing node", w, re.I)], warnings


_REDELIVER_JS = """
const node = window.app.graph.getNodeById(arguments[0]);
node.widgets.find((w) => w.name === arguments[1]).element.remove();
node.onExecuted({text: [arguments[2]]});
"""


@pytest.mark.parametrize(("name", "frontend", "renderer"), RUNS)
def test_cpu_template_runs_and_shows_reports(ui_page, ui_session, shots_dir, name, frontend, renderer):
    """The CPU template runs from the Run button; each pack node then shows its report (the same text as
    ``/history``) in a box on the node, and VRAM Monitor also shows its plot image: on the classic canvas and
    in Vue nodes (``renderer``), with the host's frontend and the newest one (``frontend``). No toast repeats
    a verdict the node shows; under Vue nodes, a node that does not host its report gets one."""
    page = ui_page
    page.open_template(name)
    shown = page.frontend()
    assert shown["vue"] == RENDERERS[renderer], shown
    tag = f"{_file_part(name)}_{shown['version']}_{renderer}"
    # ComfyUI sends no report for a node it has cached from an earlier run (here: another tab, whose outputs
    # newer frontends keep apart): free the cache as a user does, so that every pack node runs
    page.command("Comfy.Memory.UnloadModelsAndExecutionCache")
    page.close_overlays()
    page.fit_view()  # every node on screen (Vue nodes draw the ones in view)
    done = page.run()
    with contextlib.suppress(PageError):  # the assertions below say what is missing
        page.wait("every report and plot on the canvas", lambda: _settled(page.reports()), timeout=20)
    page.fit_view()
    page.screenshot(shots_dir / f"{tag}_run.png")

    history = ui_session.server.client().get(f"/history/{done['prompt_id']}")[done["prompt_id"]]
    reports = page.reports()
    assert {r["type"] for r in reports} == {n["type"] for n in _template(name)["nodes"] if n["type"] in REPORTS}
    assert {(r["renderer"], r["hosted"]) for r in reports} == {(renderer, True if renderer == "vue" else None)}
    for r in reports:
        title, rows = REPORTS[r["type"]]
        text = r["text"]
        assert text, f"no report on node {r['id']} ({r['type']})"
        assert text.startswith(f"VRAM Fit | {title}"), text
        assert [k for k in rows if not _has_row(text, k)] == [], text
        assert text == "\n".join(history["outputs"][r["id"]]["text"])
        # the verdict: the report's line under its title, shown in the header above the box, in its form
        verdict = Report.parse(text).summary
        assert verdict and r["verdict"] == verdict == text.splitlines()[1], (r["verdict"], text)
        form = VERDICTS["decode" if "Decode" in r["type"] or "Encode" in r["type"] else r["type"]]
        assert form.match(verdict), (r["type"], verdict)
        assert len(verdict) < 110, verdict
        tone = "over" if "OVER BUDGET" in verdict else "approximate" if verdict.startswith("approx") else "ok"
        assert r["tone"] == tone, (r["tone"], verdict)
        if r["type"] == "VRAMFit_VRAMMonitor":
            images = history["outputs"][r["id"]]["images"]
            assert len(r["images"]) == len(images) == 1
            assert r["images"][0]["complete"] and r["images"][0]["width"] > 0
            assert images[0]["filename"] in r["images"][0]["src"]

    # the report boxes are display only: not saved with the workflow, not sent with the next prompt
    forms = page.saved_forms()
    for node in _template(name)["nodes"]:
        if node["type"] in REPORTS:
            saved, given = forms["widgets"][str(node["id"])], node["widgets_values"]
            # the template leaves trailing optional widgets at their defaults (scripts/workflows.py); the frontend
            # saves them (allow_approximate: False), never the report's text
            assert saved[: len(given)] == given, (saved, given)
            assert all(not isinstance(v, str) for v in saved[len(given) :]), saved
            assert REPORT_WIDGET not in forms["inputs"][str(node["id"])]

    for r in reports:
        box, node_rect = page.show_report(r["id"])
        page.screenshot(shots_dir / f"{tag}_{r['id']}_report.png")
        assert box.is_displayed(), f"report box of node {r['id']} is not displayed"
        assert box.rect["height"] >= 40 and is_inside(box.rect, node_rect), (box.rect, node_rect)
        # the first line shown on the node is the verdict: its header is visible, above the report text
        head, area = page.shown_lines(box)
        assert head.is_displayed() and area.is_displayed(), r["id"]
        assert area.rect["height"] >= MIN_BOX_PX, (r["id"], area.rect)
        assert head.text.strip() == r["verdict"], (head.text, r["verdict"])
        assert head.rect["y"] + head.rect["height"] <= area.rect["y"] + 1, (head.rect, area.rect)
        assert is_inside(head.rect, node_rect), (head.rect, node_rect)
        weight = head.value_of_css_property("font-weight")
        assert weight in ("700", "bold"), weight

    # the node showed every verdict: no toast repeats one (web/js/vramfit.js toasts only unshown reports)
    toasts = page.overlays()
    assert not [t for t in toasts for r in reports if r["verdict"] in t], toasts
    if renderer == "vue":
        # a Vue node that does not host the report widget: its next report's verdict comes as a toast
        r = next(r for r in reports if r["type"] == "VRAMFit_TiledVAEDecode")
        page.js(_REDELIVER_JS, int(r["id"]), REPORT_WIDGET, r["text"])
        toast = page.wait("a toast with the verdict", lambda: [t for t in page.overlays() if r["verdict"] in t], 10)
        page.screenshot(shots_dir / f"{tag}_{r['id']}_toast.png")
        assert f"#{r['id']}" in toast[0], toast
        page.close_overlays()
