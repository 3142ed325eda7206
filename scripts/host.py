"""The real ComfyUI host used by VRAM Fit's tests, demo and benchmarks.

Three ways in, all on the ComfyUI that ``scripts/setup_host.sh`` installed (or ``$COMFYUI_PATH``):

* :func:`import_comfy` puts ComfyUI on ``sys.path`` in ``--cpu`` mode so ``comfy.*`` imports
  (enough to build models or call ``comfy.sd``);
* :func:`load_comfy_in_process` also loads every node (core, ``comfy_extras`` and custom nodes,
  this pack included) through ComfyUI's real custom-node loader and returns its ``nodes`` module;
* :class:`ComfyServer` starts ``main.py`` headless on 127.0.0.1, and :class:`ComfyClient` speaks
  its HTTP API (``POST /prompt`` → ``/history``), raising :class:`WorkflowError` with ComfyUI's
  own error text when a prompt is rejected or fails;
* :func:`clone_node`, :func:`prompt_executor` and :func:`core_decode_tiled` call the ComfyUI internals
  the tests drive directly the way the running host expects (they changed between 0.3.75 and 0.33).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger("vramfit.host")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACK_LINK_NAME = "ComfyUI-VRAM-Fit"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("VRAMFIT_CACHE", ROOT / ".cache"))


class HostNotInstalled(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class HostConfig:
    """Where the host ComfyUI and its python are (from the environment or ``.cache/host.env``)."""

    comfyui_path: pathlib.Path
    python: pathlib.Path
    front_end_root: pathlib.Path | None
    version: str = "unknown"
    """``__version__`` of the host's ``comfyui_version.py``."""

    @property
    def models_dir(self) -> pathlib.Path:
        return self.comfyui_path / "models"

    @property
    def pack_dir(self) -> pathlib.Path:
        return self.comfyui_path / "custom_nodes" / PACK_LINK_NAME

    @classmethod
    def load(cls) -> HostConfig:
        values: dict[str, str] = {}
        env_file = cache_dir() / "host.env"
        if env_file.is_file():
            for line in env_file.read_text().splitlines():
                key, sep, value = line.partition("=")
                if sep:
                    values[key.strip()] = value.strip()
        # The environment wins (scripts/test.sh exports the env file of the host it set up).
        env_set = os.environ.get("COMFYUI_PATH")
        for key in ("COMFYUI_PATH", "VRAMFIT_PYTHON", "VRAMFIT_FRONT_END_ROOT"):
            if os.environ.get(key) or (env_set and key in os.environ):
                values[key] = os.environ[key]
        if not values.get("COMFYUI_PATH"):
            raise HostNotInstalled(
                "No ComfyUI host found: run `bash scripts/setup_host.sh` first "
                "(or set COMFYUI_PATH to an existing ComfyUI)."
            )
        comfy = pathlib.Path(values["COMFYUI_PATH"]).resolve()
        if not (comfy / "main.py").is_file():
            raise HostNotInstalled(f"COMFYUI_PATH={comfy} has no main.py: not a ComfyUI folder.")
        fe = values.get("VRAMFIT_FRONT_END_ROOT") or ""
        return cls(
            comfyui_path=comfy,
            python=pathlib.Path(values.get("VRAMFIT_PYTHON") or sys.executable),
            front_end_root=pathlib.Path(fe) if fe else None,
            version=comfyui_version(comfy),
        )


def comfyui_version(comfy: pathlib.Path) -> str:
    """The ``__version__`` in ``<comfy>/comfyui_version.py`` (``"unknown"`` when absent)."""
    try:
        text = (pathlib.Path(comfy) / "comfyui_version.py").read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "__version__":
            return value.strip().strip("\"'")
    return "unknown"


# --------------------------------------------------------------------------- in-process host


DEVICE_ENV = "VRAMFIT_COMFY_DEVICE"
"""``cpu`` (default: ComfyUI runs with ``--cpu``) or ``cuda`` (the GPU suite: ComfyUI picks the GPU)."""
DYNAMIC_ENV = "VRAMFIT_DYNAMIC_VRAM"
"""On an accelerator with ComfyUI >= 0.33: ``on`` (ComfyUI's default on NVIDIA) or ``off``
(``--disable-dynamic-vram``)."""
DYNAMIC_VRAM_STATUS = "not started"
"""What :func:`load_comfy_in_process` found: ``on``, ``off (...)``, ``not on this host``, ``failed: ...``."""


def wanted_cpu() -> bool:
    """In-process hosts run ``--cpu`` unless ``$VRAMFIT_COMFY_DEVICE`` names an accelerator."""
    return os.environ.get(DEVICE_ENV, "cpu").strip().lower() in ("", "cpu")


def import_comfy(cfg: HostConfig | None = None, cpu: bool | None = None) -> HostConfig:
    """Make ``import comfy.*`` work in this process (ComfyUI first on sys.path; ``--cpu`` unless
    ``cpu=False`` or, by default, ``$VRAMFIT_COMFY_DEVICE`` names an accelerator)."""
    cfg = cfg or HostConfig.load()
    cpu = wanted_cpu() if cpu is None else cpu
    path = str(cfg.comfyui_path)
    # ComfyUI's top-level modules (``nodes``, ``utils``, ...) must win over anything else on the path.
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    loaded = sys.modules.get("nodes")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(path):
        raise RuntimeError(f"a different 'nodes' module is already imported: {loaded!r}")
    import comfy.options  # noqa: F401  (keeps ComfyUI's argv parsing off)

    # main.py imports ComfyUI's ``utils`` package before ``nodes.py`` puts ``comfy/`` first on
    # sys.path (after which ``import utils`` would find ``comfy/utils.py``); do the same.
    if (cfg.comfyui_path / "utils" / "__init__.py").is_file():
        import utils  # noqa: F401
    from comfy.cli_args import args

    if cpu and not args.cpu:
        if "comfy.model_management" in sys.modules:
            raise RuntimeError("comfy.model_management was imported before --cpu could be set")
        args.cpu = True
    if not cpu and "comfy.model_management" not in sys.modules:
        _init_dynamic_vram(args)
    return cfg


def _init_dynamic_vram(args: Any) -> None:
    """main.py's first dynamic-VRAM step (ComfyUI >= 0.33), before ``comfy.model_management`` is imported:
    ``--disable-dynamic-vram`` when ``$VRAMFIT_DYNAMIC_VRAM`` is ``off``, else ``comfy_aimdo.control.init``
    when ComfyUI would enable it (same keyword fallbacks as main.py)."""
    global DYNAMIC_VRAM_STATUS
    import comfy.cli_args as cli

    if not hasattr(cli, "enables_dynamic_vram"):
        DYNAMIC_VRAM_STATUS = "not on this host"
        return
    if os.environ.get(DYNAMIC_ENV, "on").strip().lower() == "off":
        args.disable_dynamic_vram = True
    if not cli.enables_dynamic_vram():
        DYNAMIC_VRAM_STATUS = "off (--disable-dynamic-vram or a flag that excludes it)"
        return
    import comfy_aimdo.control as control

    headroom = None if getattr(args, "reserve_vram", None) is None else int(args.reserve_vram * 1024**3)
    for kwargs in (
        {"simple_vram_headroom": headroom, "nvml_pressure": not getattr(args, "disable_nvml_pressure", False)},
        {"simple_vram_headroom": headroom},
        {},
    ):
        try:
            control.init(**kwargs)
            break
        except TypeError:
            continue
    DYNAMIC_VRAM_STATUS = "initialising"


def _start_dynamic_vram() -> None:
    """main.py's second dynamic-VRAM step, after ``comfy.model_management`` is imported: register the
    devices with comfy-aimdo and switch ComfyUI to ``ModelPatcherDynamic``."""
    global DYNAMIC_VRAM_STATUS
    if DYNAMIC_VRAM_STATUS != "initialising":
        return
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy_aimdo.control as control
    from comfy.cli_args import args

    if not mm.is_nvidia() or mm.torch_version_numeric < (2, 8):
        DYNAMIC_VRAM_STATUS = "off (not supported: needs NVIDIA and torch >= 2.8)"
        return
    devices = mm.get_all_torch_devices()
    try:
        ok = control.init_devices((d.index, int(args.vram_headroom * 1024**3)) for d in devices)
    except TypeError:
        ok = control.init_devices(d.index for d in devices)
    if not ok:
        DYNAMIC_VRAM_STATUS = "failed: comfy-aimdo did not initialise (ComfyUI falls back to ModelPatcher)"
        return
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    DYNAMIC_VRAM_STATUS = "on"


_NODES_MODULE: Any = None


def load_comfy_in_process(cfg: HostConfig | None = None, cpu: bool | None = None) -> Any:
    """Load a ComfyUI host in this process, every node included, and return its ``nodes`` module.

    Custom nodes (this pack among them, linked into ``custom_nodes/`` by the installer) are loaded
    by ComfyUI's own ``init_extra_nodes``, exactly as ``main.py`` does at start-up. On an accelerator
    (``cpu=False`` or ``$VRAMFIT_COMFY_DEVICE``), dynamic VRAM is set up as main.py does.
    """
    global _NODES_MODULE
    if _NODES_MODULE is not None:
        return _NODES_MODULE
    cfg = import_comfy(cfg, cpu=cpu)
    import nodes  # ComfyUI's nodes.py

    _start_dynamic_vram()
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
    _NODES_MODULE = nodes
    return nodes


def pack_module_name() -> str:
    """The module name ComfyUI's loader gives this pack (the folder name in custom_nodes/)."""
    return PACK_LINK_NAME


# --------------------------------------------------------------------------- host internals the tests call
# The few ComfyUI internals the tests drive directly changed between the supported hosts; each function
# below calls them the way the running host expects, detected from the host's own signatures, so the
# tests themselves hold no version checks.


def clone_node(cls: Any, unique_id: str, **hidden: Any) -> Any:
    """``cls.PREPARE_CLASS_CLONE`` with hidden inputs (``unique_id``, ``prompt=``, ``extra_pnginfo=``...),
    as ComfyUI's executor prepares a V3 node before ``execute``.

    0.3.75 takes the hidden inputs themselves; 0.33 takes ``v3_data`` holding them under ``hidden_inputs``.
    """
    inputs = {"UNIQUE_ID": unique_id} | {name.upper(): value for name, value in hidden.items()}
    first = next(iter(inspect.signature(cls.PREPARE_CLASS_CLONE).parameters))
    return cls.PREPARE_CLASS_CLONE({"hidden_inputs": inputs} if first == "v3_data" else inputs)


class StubPromptServer:
    """What ComfyUI's PromptExecutor needs from a server when nobody listens."""

    client_id = None
    last_node_id = None
    last_prompt_id = None

    def send_sync(self, *args: Any, **kwargs: Any) -> None:
        pass


def prompt_executor(server: Any = None) -> Any:
    """ComfyUI's ``execution.PromptExecutor`` with the classic cache, as ``main.py --cache-classic`` makes it.

    ``cache_args`` carries every key some supported host's executor reads, with ``main.py``'s values for the
    classic cache (0.33 reads ``ram_inactive`` on every prompt; 0.3.75 reads ``lru`` and ``ram`` only).
    """
    import execution

    cache_args = {"lru": 0, "ram": 0, "ram_inactive": 0}
    return execution.PromptExecutor(
        server or StubPromptServer(), cache_type=execution.CacheType.CLASSIC, cache_args=cache_args
    )


def core_decode_tiled(nodes_module: Any, vae: Any, latent: dict, *args: Any) -> Any:
    """Core ``VAEDecodeTiled().decode(vae, latent, *args)[0]`` as ComfyUI's executor runs it: under
    ``torch.inference_mode()`` (0.33's decode adds in place to a tensor made in inference mode, which
    raises outside it). Returns an ordinary tensor (a copy), usable in autograd-tracked code."""
    import torch

    with torch.inference_mode():
        image = nodes_module.VAEDecodeTiled().decode(vae, latent, *args)[0]
    return image.clone()


# --------------------------------------------------------------------------- HTTP server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkflowError(RuntimeError):
    """ComfyUI rejected or failed a prompt; the message is ComfyUI's own error text."""

    def __init__(self, message: str, details: Any = None):
        super().__init__(message)
        self.details = details


class ComfyClient:
    """Minimal client of ComfyUI's HTTP API (stdlib only)."""

    def __init__(self, base_url: str, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        return self._request("GET", path)

    def object_info(self, node_type: str | None = None) -> dict:
        if node_type:
            return self.get("/object_info/" + urllib.parse.quote(node_type))
        return self.get("/object_info")

    def system_stats(self) -> dict:
        return self.get("/system_stats")

    def queue(self, workflow: dict) -> str:
        """POST an API-format workflow; returns the prompt id.

        Raises WorkflowError when ComfyUI rejects the prompt *or any part of it*: ComfyUI answers 200
        and runs the valid outputs when only some output nodes fail validation (the others are listed
        in ``node_errors`` and silently skipped), which must not pass as success. The queued remainder
        is removed from the queue (best effort; it may already be running).
        """
        try:
            reply = self._request("POST", "/prompt", {"prompt": workflow, "client_id": self.client_id})
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            try:
                details = json.loads(body)
            except ValueError:
                details = body
            raise WorkflowError(format_validation_error(details), details) from None
        if reply.get("node_errors"):
            with contextlib.suppress(OSError):
                self._request("POST", "/queue", {"delete": [reply["prompt_id"]]})
            message = format_validation_error(reply).replace(
                "ComfyUI rejected the prompt:",
                "ComfyUI rejected part of the prompt (those outputs would not run):",
                1,
            )
            raise WorkflowError(message, reply)
        return reply["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 900.0, poll: float = 0.2) -> dict:
        """Poll ``/history/<id>`` until the prompt finished; returns its history entry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get("/history/" + prompt_id)
            entry = hist.get(prompt_id) if hist else None
            if entry and entry.get("status", {}).get("completed") is not None:
                status = entry["status"]
                if status.get("status_str") == "error":
                    raise WorkflowError(format_execution_error(status), entry)
                if status.get("completed"):
                    return entry
            time.sleep(poll)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def run(self, workflow: dict, timeout: float = 900.0) -> dict:
        """Queue a workflow and wait for it; returns the history entry (``outputs``, ``status``)."""
        return self.wait(self.queue(workflow), timeout=timeout)


def format_validation_error(details: Any) -> str:
    if not isinstance(details, dict):
        return f"ComfyUI rejected the prompt: {details}"
    err = details.get("error") or {}
    lines = [f"ComfyUI rejected the prompt: {err.get('message', '')} {err.get('details', '')}".rstrip()]
    for node_id, node_err in (details.get("node_errors") or {}).items():
        for e in node_err.get("errors", []):
            lines.append(
                f"  node {node_id} ({node_err.get('class_type')}): {e.get('message')}: {e.get('details')}"
            )
    return "\n".join(lines)


def format_execution_error(status: dict) -> str:
    for kind, msg in status.get("messages", []):
        if kind == "execution_error":
            return (
                f"ComfyUI failed in node {msg.get('node_id')} ({msg.get('node_type')}): "
                f"{msg.get('exception_type')}: {msg.get('exception_message')}"
            )
    return f"ComfyUI failed the prompt: {status}"


def output_files(
    entry: dict, output_dir: pathlib.Path, temp_dir: pathlib.Path | None = None
) -> list[pathlib.Path]:
    """Paths of the files a finished prompt saved (images, animated images, videos).

    ``type: "temp"`` previews are looked up in ``temp_dir`` (ComfyUI's ``--temp-directory X`` writes
    them to ``X/temp``) and left out when it is not given.
    """
    paths = []
    for node_out in entry.get("outputs", {}).values():
        for key in ("images", "gifs", "videos", "animated"):
            for item in node_out.get(key, []) or []:
                if not (isinstance(item, dict) and "filename" in item):
                    continue
                kind = item.get("type", "output")
                base = output_dir if kind == "output" else temp_dir if kind == "temp" else None
                if base is not None:
                    paths.append(base / item.get("subfolder", "") / item["filename"])
    return paths


class ComfyServer:
    """A real ComfyUI server (``main.py --cpu``) on 127.0.0.1 with its own output/temp/user folders."""

    def __init__(
        self,
        cfg: HostConfig | None = None,
        port: int | None = None,
        work_dir: pathlib.Path | None = None,
        extra_args: Sequence[str] = (),
        cpu: bool = True,
    ):
        self.cfg = cfg or HostConfig.load()
        self.port = port or free_port()
        self._own_tmp = None
        if work_dir is None:
            self._own_tmp = tempfile.TemporaryDirectory(prefix="vramfit-server-")
            work_dir = pathlib.Path(self._own_tmp.name)
        self.work_dir = pathlib.Path(work_dir)
        self.output_dir = self.work_dir / "output"
        self.user_dir = self.work_dir / "user"
        self.input_dir = self.work_dir / "input"
        self.temp_dir = self.work_dir / "temp" / "temp"  # ComfyUI appends "temp" to --temp-directory
        self.log_path = self.work_dir / "comfyui.log"
        self.extra_args = list(extra_args)
        self.cpu = cpu
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 30.0) -> ComfyClient:
        return ComfyClient(self.url, timeout=timeout)

    def command(self) -> list[str]:
        for d in (self.output_dir, self.user_dir, self.input_dir, self.work_dir / "temp"):
            d.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(self.cfg.python), "main.py",
            "--listen", "127.0.0.1", "--port", str(self.port), "--disable-auto-launch",
            "--output-directory", str(self.output_dir),
            "--input-directory", str(self.input_dir),
            "--temp-directory", str(self.work_dir / "temp"),
            "--user-directory", str(self.user_dir),
            "--database-url", "sqlite:///:memory:",
        ]  # fmt: skip
        if self.cpu:
            cmd.append("--cpu")
        if self.cfg.front_end_root is not None:
            self.cfg.front_end_root.mkdir(parents=True, exist_ok=True)
            cmd += ["--front-end-root", str(self.cfg.front_end_root)]
        return cmd + self.extra_args

    def start(self, timeout: float = 180.0) -> ComfyServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.command(), cwd=self.cfg.comfyui_path, stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        client = self.client(timeout=5.0)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                client.get("/object_info/VAEDecode")
                log.info("ComfyUI server ready at %s (log: %s)", self.url, self.log_path)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_tmp is not None:
            self._own_tmp.cleanup()
            self._own_tmp = None

    def __enter__(self) -> ComfyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_server(**kwargs: Any) -> Iterator[ComfyServer]:
    server = ComfyServer(**kwargs).start()
    try:
        yield server
    finally:
        server.stop()


def pack_import_problems(log_text: str) -> list[str]:
    """Lines of a ComfyUI log saying this pack failed to import or register its nodes."""
    bad = []
    for line in log_text.splitlines():
        if PACK_LINK_NAME not in line:
            continue
        if "IMPORT FAILED" in line or "Cannot import" in line or "comfy_entrypoint" in line or "Skip" in line:
            bad.append(line.strip())
    return bad
