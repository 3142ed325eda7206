"""Headless runner: submit an API-format workflow to a ComfyUI server and follow it.

    python -m scripts.run_workflow workflows/api/vramfit_demo_cpu.json --url http://127.0.0.1:8188

Follows the prompt on ComfyUI's websocket (progress per node), then reads ``/history`` and prints
every VRAM Fit report (plan / offload / monitor) and the output files. Exits 0 on success and 1
with ComfyUI's own error text when the prompt is rejected (validation) or fails (execution).
Runs with any python that has ``aiohttp`` (ComfyUI's own environment has it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import pathlib
import sys
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from scripts.host import ComfyClient, WorkflowError, format_execution_error

log = logging.getLogger("vramfit.run")

REPORT_PREFIX = "VRAM Fit | "


@dataclass
class RunResult:
    prompt_id: str
    entry: dict
    seconds: float
    progress_events: int = 0
    reports: list[str] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)


def collect_reports(entry: dict) -> list[str]:
    """VRAM Fit report texts found in a history entry's UI outputs (``{"text": [...]}``)."""
    found = []
    for node_out in entry.get("outputs", {}).values():
        for text in node_out.get("text", []) or []:
            if isinstance(text, str) and text.startswith(REPORT_PREFIX):
                found.append(text)
    return found


def collect_outputs(entry: dict) -> list[dict]:
    """``{"filename", "subfolder", "type"}`` of every saved file in a history entry."""
    files = []
    for node_out in entry.get("outputs", {}).values():
        for key in ("images", "gifs", "videos", "animated"):
            for item in node_out.get(key, []) or []:
                if isinstance(item, dict) and "filename" in item:
                    files.append(item)
    return files


async def _follow(url: str, client: ComfyClient, workflow: dict, timeout: float) -> tuple[str, int]:
    """Queue the workflow with the websocket open; return (prompt_id, progress events seen)."""
    import aiohttp

    parsed = urllib.parse.urlparse(url)
    scheme = "wss" if parsed.scheme == "https" else "ws"
    ws_url = f"{scheme}://{parsed.netloc}/ws?clientId={client.client_id}"
    events = 0
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, heartbeat=30) as ws:
        prompt_id = await asyncio.to_thread(client.queue, workflow)
        log.info("queued prompt %s", prompt_id)
        deadline = time.monotonic() + timeout
        node_types = {k: v.get("class_type", "?") for k, v in workflow.items()}
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")
            msg = await ws.receive(timeout=remaining)
            if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                raise ConnectionError(f"websocket closed while prompt {prompt_id} was running")
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue  # binary previews
            data = json.loads(msg.data)
            kind, body = data.get("type"), data.get("data") or {}
            if body.get("prompt_id") not in (None, prompt_id):
                continue
            if kind == "executing":
                node = body.get("node")
                if node is None:
                    return prompt_id, events
                log.info("running node %s (%s)", node, node_types.get(node, "?"))
            elif kind == "progress":
                events += 1
                log.info("  node %s: %s/%s", body.get("node"), body.get("value"), body.get("max"))
            elif kind == "execution_error":
                raise WorkflowError(format_execution_error({"messages": [["execution_error", body]]}), body)
            elif kind == "execution_success":
                return prompt_id, events


def run(url: str, workflow: dict, timeout: float = 3600.0) -> RunResult:
    """Submit ``workflow`` to the server at ``url`` and wait for it; raises WorkflowError on failure."""
    client = ComfyClient(url, timeout=60.0)
    t0 = time.perf_counter()
    prompt_id, events = asyncio.run(_follow(url, client, workflow, timeout))
    entry = client.wait(prompt_id, timeout=60.0)  # history is written right after the last event
    return RunResult(
        prompt_id=prompt_id,
        entry=entry,
        seconds=time.perf_counter() - t0,
        progress_events=events,
        reports=collect_reports(entry),
        outputs=collect_outputs(entry),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workflow", type=pathlib.Path, help="API-format workflow JSON (workflows/api/*.json)")
    parser.add_argument("--url", default="http://127.0.0.1:8188", help="ComfyUI server URL")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the prompt")
    parser.add_argument(
        "--output-dir", type=pathlib.Path, default=None, help="the server's output folder, to print full paths"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        workflow = json.loads(args.workflow.read_text())
    except (OSError, ValueError) as e:
        log.error("cannot read workflow %s: %s", args.workflow, e)
        return 2
    try:
        result = run(args.url, workflow, timeout=args.timeout)
    except WorkflowError as e:
        log.error("%s", e)
        return 1
    except (OSError, TimeoutError, ConnectionError) as e:
        log.error("cannot run the workflow on %s: %s", args.url, e)
        return 1
    log.info("prompt %s finished in %.1f s", result.prompt_id, result.seconds)
    for text in result.reports:
        log.info("%s", text)
    for item in result.outputs:
        rel = pathlib.Path(item.get("subfolder", "")) / item["filename"]
        where = (args.output_dir / rel) if args.output_dir else f"{item.get('type', 'output')}/{rel}"
        log.info("output: %s", where)
    return 0


def _entry() -> Any:  # pragma: no cover - CLI
    sys.exit(main())


if __name__ == "__main__":
    _entry()
