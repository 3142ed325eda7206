"""GPU suite worker: one part (``image``, ``encode``, ``video`` or ``scenes``) on one ComfyUI host, in-process.

Started by ``bench/gpu_suite.py`` (never by hand; see docs/BENCHMARKS.md "GPU suite") with
``COMFYUI_PATH`` naming the host and ``VRAMFIT_COMFY_DEVICE`` / ``VRAMFIT_DYNAMIC_VRAM`` naming the mode.
It loads the host as ``main.py`` would (dynamic VRAM included), generates the random-weight models it
needs, runs ComfyUI's own nodes and this pack's side by side and appends one row per measured decode
(or encode) to ``--json`` after each row (a run stopped at its deadline keeps what it finished).

Per row: wall seconds; on CUDA ``max_memory_allocated`` above the allocated bytes at entry (``peak``)
and in absolute terms (``peak_abs``: resident weights included), and the driver-level used memory,
sampled every 2 ms from ``mem_get_info`` (``device_peak``: sees comfy-aimdo's weight pages, which torch's
allocator does not); on CPU the live-tensor peak (``PeakTracker`` dispatch count). Fidelity: PSNR and
max abs diff against the reference decode named in the row (``encode``: the latent's max abs diff, then the
round trip's PSNR, bench/encode.py's: core VAEDecode of the row's latent vs of the reference latent).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import math
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

log = logging.getLogger("vramfit.bench.gpu_parts")
MiB = 2**20
IMAGE_NODE = "VRAMFit_TiledVAEDecode"
VIDEO_NODE = "VRAMFit_TemporalChunkVideoDecode"

IMAGE_SIZES = {"full": [2048, 4096, 8192], "small": [64]}
ENCODE_SIZES = {"full": [2048, 4096], "small": [64, 128]}
IMAGE_BUDGET_24G_FROM_PX = 8192
"""From this size on, the budgeted row uses 24 GB (the issue's 8192² case); below, 40 % of core's peak."""
VIDEO_CASES = {
    "full": [("wan21", (1, 16, 21, 60, 104), "832x480x81"), ("wan21", (1, 16, 21, 90, 160), "1280x720x81"),
             ("hunyuan_video15", (1, 32, 31, 45, 80), "1280x720x121"),
             ("ltx_video", (1, 128, 16, 16, 24), "768x512x121"), ("ltx_video", (1, 128, 16, 34, 60), "1920x1088x121"),
             ("mochi", (1, 12, 15, 60, 106), "848x480x85"), ("cogvideox", (1, 16, 13, 60, 90), "720x480x49"),
             ("wan22", (1, 48, 21, 30, 52), "832x480x81"), ("wan22", (1, 48, 21, 45, 80), "1280x720x81")],
    "small": [("wan21", (1, 16, 2, 6, 6), "48x48x5"), ("ltx_video_narrow", (1, 128, 2, 2, 2), "64x64x9")],
}  # fmt: skip
"""The video part's cases, in the order they run (the deadline keeps the rows done): Wan 2.1 first, then every
carried family at its users' sizes (HunyuanVideo 1.5 720p, LTX-Video 768x512 and 1080p x 121, Mochi 848x480,
CogVideoX 720x480: ComfyUI 0.33+ only), Wan 2.2 last; ``--models`` picks families (a narrow twin counts as its
family). The dry run adds one carried family, LTX-Video's narrow twin (``scripts.fixtures.kinds.NARROW_KINDS``), to keep
its time near Wan's alone."""
VIDEO_BUDGETS = (("auto", 0.0), ("40% of core's peak", 0.4), ("20% of core's peak", 0.2))
"""VRAM Fit's rows per video case: ``budget_mb`` 0 (free memory) and fractions of core VAEDecode's peak."""
ENCODE_VIDEO_CASES = {
    "full": [(kind, label) for kind, _, label in VIDEO_CASES["full"]]
    + [("ltx_video", "1920x1088x121"), ("hunyuan_video15", "1280x720x121")],
    "small": [("wan21", "48x48x5"), ("hunyuan_video15", "64x64x9")],
}
"""The encode part's video cases (``--models`` picks): Wan's decode sizes, LTX-Video at 1080p (its 16-latent-px
reach leaves tiles only across the width), HunyuanVideo 1.5 at 720p."""
SCENE_SIZES = {
    # (PixArt depth, DC-AE latent, FLUX double/single blocks, FLUX latent, bf16 Loader weight dtype)
    "full": (75, (2, 32, 64, 64), (19, 38), (1, 16, 128, 128), "fp8_e4m3fn"),
    "small": (2, (2, 32, 2, 2), (1, 0), (1, 16, 8, 8), "bf16"),
}


# --------------------------------------------------------------------------------------------------
# Measurement


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _DeviceUsedSampler:
    """Highest driver-level used memory (``total - free`` from ``mem_get_info``) seen every 2 ms."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free)
            self._stop.wait(0.002)

    def __enter__(self) -> _DeviceUsedSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(device: torch.device, fn: Callable[[], Any], tracker: Any) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` once; returns its result and the figures of the module docstring."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        with _DeviceUsedSampler(device) as used:
            out = fn()
            _sync(device)
        seconds = time.perf_counter() - t0
        peak_abs = torch.cuda.max_memory_allocated(device)
        return out, {"seconds": seconds, "peak_mib": (peak_abs - base) / MiB, "peak_abs_mib": peak_abs / MiB,
                     "device_peak_mib": used.peak / MiB, "measure": "max_memory_allocated"}
    t0 = time.perf_counter()
    with tracker.PeakTracker("cpu", method="dispatch") as t:
        out = fn()
    return out, {"seconds": time.perf_counter() - t0, "peak_mib": t.peak_bytes / MiB, "peak_abs_mib": None,
                 "device_peak_mib": None, "measure": "live tensors (dispatch)"}


def fidelity(out: torch.Tensor | None, ref: torch.Tensor | None) -> dict[str, Any]:
    if out is None or ref is None or out.shape != ref.shape:
        return {"psnr_db": None, "max_abs": None}
    diff = out.double() - ref.double()
    mse = diff.pow(2).mean().item()
    return {"psnr_db": math.inf if mse == 0 else 10 * math.log10(1.0 / mse), "max_abs": diff.abs().max().item()}


@contextlib.contextmanager
def log_watch(needle: str) -> Iterator[list[str]]:
    """Collect log messages containing ``needle`` (e.g. core VAE Decode's fallback to tiles)."""
    seen: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if needle in msg:
                seen.append(msg)

    h = Handler()
    logging.getLogger().addHandler(h)
    try:
        yield seen
    finally:
        logging.getLogger().removeHandler(h)


class Rows:
    """The worker's JSON file: ``{"meta": {...}, "rows": [...]}``, rewritten after every row."""

    def __init__(self, path: pathlib.Path, meta: dict[str, Any]):
        self.path, self.meta, self.rows = path, meta, []
        self._write()

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        log.info("row: %s", json.dumps(row, default=str))
        self._write()
        return row

    def update(self, row: dict[str, Any], **values: Any) -> None:
        """Fill in columns of a row written earlier (figures computed after the measurements)."""
        row.update(values)
        log.info("row update: %s", json.dumps(values, default=str))
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1, default=str))
        tmp.replace(self.path)


def ours(rows: Rows, host: Host, common: dict[str, Any], label: str, budget: int, fn: Callable[[], Any],
         score: Callable[[Any], dict[str, Any]], op: str = "decode",
         **extra: Any) -> tuple[Any, dict[str, Any]] | None:
    """Measure one VRAM Fit ``op`` (decode or encode) and add its row, ``score(result)`` its fidelity columns;
    returns the result and its row. A refused budget becomes a row saying why (and returns None)."""
    try:
        r, m = measure(host.device, fn, host.tracker)
    except Exception as e:  # e.g. a budget below the smallest plan: the table says so
        rows.add(**common, **{op: f"VRAM Fit {label}"}, budget_mb=budget, error=f"{type(e).__name__}: {e}",
                 path=f"refused: {str(e)[:200]}", **extra)
        return None
    row = rows.add(**common, **{op: f"VRAM Fit {label}"}, budget_mb=budget, **m, **score(r),
                   predicted_mib=getattr(r.plan, "planned", 0) / MiB, **_plan_of(r), **extra)
    return r, row


def _plan_of(result: Any) -> dict[str, Any]:
    rows = dict(result.report.rows)
    return {"path": rows.get("path", ""), "plan": rows.get("plan", ""), "budget": rows.get("budget", "")}


# --------------------------------------------------------------------------------------------------
# The host


class Host:
    """The in-process ComfyUI: its ``nodes`` module, this pack's modules, the device and mode."""

    def __init__(self) -> None:
        from scripts import host as host_mod

        self.host_mod = host_mod
        self.cfg = host_mod.HostConfig.load()
        self.nodes = host_mod.load_comfy_in_process(self.cfg)
        import comfy.model_management as mm

        self.mm = mm
        self.device = torch.device(mm.get_torch_device())
        pack = self.nodes.NODE_CLASS_MAPPINGS[IMAGE_NODE].__module__.rsplit(".nodes.", 1)[0]
        self.tiled = importlib.import_module(pack + ".nodes.tiled_vae_decode")
        self.tiled_encode = importlib.import_module(pack + ".nodes.tiled_vae_encode")
        self.video = importlib.import_module(pack + ".nodes.video_decode")
        self.offload = importlib.import_module(pack + ".nodes.offload_manager")
        self.bf16 = importlib.import_module(pack + ".nodes.bf16_loader")
        self.tracker = importlib.import_module(pack + ".memory.measure.tracker")

    def meta(self, part: str, size: str) -> dict[str, Any]:
        kitchen = "absent"
        with contextlib.suppress(ImportError):
            from comfy_kitchen.backends import cuda as ck_cuda

            kitchen = "loaded" if getattr(ck_cuda, "_C", None) is not None else "not loaded (eager/triton backends)"
        return {
            "part": part, "size": size, "comfyui": self.cfg.version, "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dynamic_vram": self.host_mod.DYNAMIC_VRAM_STATUS,
            "comfy_kitchen_cuda": kitchen, "date": time.strftime("%Y-%m-%d"),
        }  # fmt: skip

    def vae(self, kind: str) -> Any:
        from scripts.fixtures.files import load_vae

        # Sana's DC-AE in ComfyUI_ExtraModels' default dtype (bf16) on a GPU
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        return load_vae(self.nodes, kind, self.cfg.models_dir / "vae", dtype)

    def core_decode(self, vae: Any, z: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.nodes.VAEDecode().decode(vae, {"samples": z})[0].clone()

    def core_tiled(self, vae: Any, z: torch.Tensor, *args: Any) -> torch.Tensor:
        return self.host_mod.core_decode_tiled(self.nodes, vae, {"samples": z}, *args)

    def core_encode(self, vae: Any, pixels: torch.Tensor, *tiled: int) -> torch.Tensor:
        """Core ``VAEEncode``, or ``VAEEncodeTiled`` given its tile size and overlap (inference mode, as the
        executor runs nodes)."""
        node = self.nodes.VAEEncodeTiled() if tiled else self.nodes.VAEEncode()
        with torch.inference_mode():
            return node.encode(vae, pixels, *tiled)[0]["samples"].clone()

    def unload_all(self) -> None:
        self.mm.unload_all_models()
        gc.collect()
        self.mm.soft_empty_cache()


# --------------------------------------------------------------------------------------------------
# Parts


def part_image(host: Host, rows: Rows, size: str, sizes: list[int] | None = None) -> None:
    """KL VAE at 2048²-8192² (or ``sizes``): core VAEDecode, core VAEDecodeTiled (512/64), VRAM Fit auto and
    budgeted."""
    from scripts.fixtures.latents import structured_latent

    vae = host.vae("kl_f8")
    # first use: the self-check and any cost-model calibration run here, not inside a measured row
    host.tiled.decode(vae, {"samples": structured_latent((1, 4, 16, 16), seed=0)}, tile_size=64)
    for px in sizes or IMAGE_SIZES[size]:
        z = structured_latent((1, 4, px // 8, px // 8), seed=px)
        common = {"case": f"KL {px}x{px}", "dtype": str(vae.vae_dtype).removeprefix("torch.")}
        with log_watch("retrying with tiled") as fallback:
            ref, m = measure(host.device, lambda z=z: host.core_decode(vae, z), host.tracker)
        untiled = not fallback
        ref_name = "core VAEDecode" + ("" if untiled else " (fell back to its tiled decode)")
        rows.add(**common, decode=ref_name, **m, psnr_db=None, max_abs=None, reference="-")
        core_peak = m["peak_mib"]
        out, m = measure(host.device, lambda z=z: host.core_tiled(vae, z, 512, 64, 64, 8), host.tracker)
        rows.add(**common, decode="core VAEDecodeTiled 512/64", **m, **fidelity(out, ref), reference=ref_name)
        del out
        budgets = [("auto", 0)]
        budgets.append(("24 GB budget", 24576) if px >= IMAGE_BUDGET_24G_FROM_PX
                       else ("40% of core's peak", max(16, int(0.4 * core_peak))))
        for label, budget in budgets:
            ours(rows, host, common, label, budget,
                 lambda z=z, b=budget: host.tiled.decode(vae, {"samples": z}, budget_mb=b),
                 lambda r, ref=ref: fidelity(r.images, ref), reference=ref_name)
        del ref
        gc.collect()


def part_encode(host: Host, rows: Rows, size: str, sizes: list[int] | None = None, kind: str = "kl_f8") -> None:
    """KL VAE (or ``kind``: ``dcae_sana``) encode at 2048² and 4096² (or ``sizes``) of bench/encode.py's image: core
    VAEEncode (the reference), core VAEEncodeTiled (its defaults, 512/64; not for DC-AE, which ComfyUI's tiled
    encode cannot run), VRAM Fit auto and at 40 % of core's peak. Each
    row is written when measured (latent max abs vs the reference); the round trips (core VAEDecode, slow at
    8192²) are filled in after a size's encodes, so a stop at the deadline keeps every measured encode."""
    from bench.encode import smooth_image

    vae = host.vae(kind)
    with torch.inference_mode():  # first use (the self-check) outside the rows
        host.tiled_encode.encode(vae, smooth_image(64), tile_size=32)
    for px in sizes or ENCODE_SIZES[size]:
        pixels = smooth_image(px)
        name = "KL" if kind == "kl_f8" else kind
        common = {"case": f"{name} {px}x{px}", "dtype": str(vae.vae_dtype).removeprefix("torch.")}
        with log_watch("retrying with tiled") as fallback:
            ref, m = measure(host.device, lambda p=pixels: host.core_encode(vae, p), host.tracker)
        ref_name = "core VAEEncode" + (" (fell back to its tiled encode)" if fallback else "")
        rows.add(**common, encode=ref_name, **m, reference="-")
        budget_40 = max(16, int(0.4 * m["peak_mib"]))
        encoded = []
        if hasattr(vae, "process_input"):  # a ComfyUI VAE (not ExtraModels' EXVAE)
            out, m = measure(host.device, lambda p=pixels: host.core_encode(vae, p, 512, 64), host.tracker)
            encoded.append((out, rows.add(**common, encode="core VAEEncodeTiled 512/64", **m,
                                          latent_max_abs=fidelity(out, ref)["max_abs"], reference=ref_name)))

        def run(b: int, p: torch.Tensor = pixels) -> Any:
            with torch.inference_mode():
                return host.tiled_encode.encode(vae, p, budget_mb=b)

        for label, budget in (("auto", 0), ("40% of core's peak", budget_40)):
            done = ours(rows, host, common, label, budget, lambda b=budget: run(b),
                        lambda r, ref=ref: {"latent_max_abs": fidelity(r.latent, ref)["max_abs"]}, op="encode",
                        reference=ref_name)
            if done:
                encoded.append((done[0].latent, done[1]))
        image_ref = host.core_decode(vae, ref)
        for z, row in encoded:
            rows.update(row, round_trip_psnr_db=fidelity(host.core_decode(vae, z), image_ref)["psnr_db"])
        del ref, encoded, image_ref, pixels
        gc.collect()


def part_encode_video(host: Host, rows: Rows, size: str, models: list[str]) -> None:
    """Video encode (``--models``: Wan, LTX-Video, HunyuanVideo 1.5) at :data:`ENCODE_VIDEO_CASES`: core VAEEncode
    (the reference), Temporal-Chunk Video Encode auto and at 40 % of core's peak; latent max abs vs the reference."""
    for kind, label in ENCODE_VIDEO_CASES[size]:
        if kind not in models:
            continue
        host.unload_all()
        vae = host.vae(kind)
        r = int(vae.spacial_compression_encode())
        with torch.inference_mode():  # first use (the self-check) outside the rows; 9 frames: LTX takes 1 + 8n
            host.tiled_encode.encode(vae, torch.rand(9, 2 * r, 4 * r, 3), tile_size=2 * r)
        w, h, t = (int(v) for v in label.split("x"))
        pixels = torch.rand((t, h, w, 3), generator=torch.Generator().manual_seed(0))
        common = {"case": f"{kind} {label}", "dtype": str(vae.vae_dtype).removeprefix("torch.")}
        ref, m = measure(host.device, lambda p=pixels, vae=vae: host.core_encode(vae, p), host.tracker)
        rows.add(**common, encode="core VAEEncode", **m, reference="-")
        for name, budget in (("auto", 0), ("40% of core's peak", max(16, int(0.4 * m["peak_mib"])))):

            def run(b: int = budget, p: torch.Tensor = pixels, vae: Any = vae) -> Any:
                with torch.inference_mode():
                    return host.tiled_encode.encode(vae, p, budget_mb=b, node="Temporal-Chunk Video Encode")

            ours(rows, host, common, name, budget, run,
                 lambda res, ref=ref: {"latent_max_abs": fidelity(res.latent, ref)["max_abs"]}, op="encode",
                 reference="core VAEEncode")
        del ref, pixels
        gc.collect()


def _video_work(r: Any) -> dict[str, Any]:
    """A video decode's planning seconds (inside its measured time), decoder calls and copies (the Wan executor's
    counts, ``stats["moves"]``: host<->device on a GPU but for a device store's), its ratios to core."""
    moves = r.stats.get("moves") or {}
    return {"plan_s": r.plan_seconds, "calls": r.stats.get("calls", r.stats.get("chunks")),
            "copies": (f"{sum(n for n, _ in moves.values())} / {sum(b for _, b in moves.values()) / MiB:,.0f} MiB"
                       if moves else None),
            "predicted_s": None}  # no time model of a video plan yet (issue 35, target 6)


def part_video(host: Host, rows: Rows, size: str, models: list[str]) -> None:
    """Every video family of :data:`VIDEO_CASES` (``models``): core VAEDecode, core VAEDecodeTiled, VRAM Fit
    auto and at 40 % and 20 % of core's peak (:data:`VIDEO_BUDGETS`), with planning seconds, decoder calls and
    copies; a family the host lacks (CogVideoX before 0.33) is skipped (logged)."""
    from scripts.fixtures.host import available
    from scripts.fixtures.kinds import FIXTURES
    from scripts.fixtures.latents import structured_latent

    for kind, shape, label in VIDEO_CASES[size]:
        family = FIXTURES[kind].full or kind
        if family not in models:
            continue
        common = {"case": f"{kind} {label}"}
        if not available(kind):
            log.info("%s skipped: ComfyUI %s has no %s VAE", common["case"], host.cfg.version, family)
            continue
        host.unload_all()
        vae = host.vae(kind)
        common["dtype"] = str(vae.vae_dtype).removeprefix("torch.")
        ratio = vae.upscale_ratio[-1] if isinstance(vae.upscale_ratio, (tuple, list)) else vae.upscale_ratio
        tiny = structured_latent((1, shape[1], 3, 4, 4), seed=0)  # first use (self-check) outside the rows
        with torch.inference_mode():
            host.video.decode(vae, {"samples": tiny}, frames_per_chunk=1, tile_size=2 * int(ratio))
        z = structured_latent(shape, seed=1)
        ref, m = measure(host.device, lambda z=z, vae=vae: host.core_decode(vae, z), host.tracker)
        rows.add(**common, decode="core VAEDecode", **m, psnr_db=None, max_abs=None)
        core_peak = m["peak_mib"]
        out, m = measure(host.device, lambda z=z, vae=vae: host.core_tiled(vae, z, 512, 64, 64, 8), host.tracker)
        rows.add(**common, decode="core VAEDecodeTiled 512/64, 64/8", **m, **fidelity(out, ref))
        del out
        for name, frac in VIDEO_BUDGETS:
            budget = max(16, int(frac * core_peak)) if frac else 0

            def run(z: torch.Tensor = z, b: int = budget, vae: Any = vae) -> Any:
                with torch.inference_mode():  # as ComfyUI runs nodes
                    return host.video.decode(vae, {"samples": z}, budget_mb=b)

            ours(rows, host, common, name, budget, run, lambda r, ref=ref: {**fidelity(r.images, ref), **_video_work(r)})
        del ref, vae
        gc.collect()


def part_scenes(host: Host, rows: Rows, size: str) -> None:
    """The field's cases: (a) Sana-class model resident + DC-AE 2048² batch 2 decode, without and with
    Offload Manager; (b) FLUX through the bf16 Loader, Offload Manager and Tiled VAE Decode (whole graph)."""
    from scripts import diffusion_fixtures as dfx
    from scripts.fixtures.latents import structured_latent

    depth, dc_shape, (fd, fs), flux_shape, flux_dtype = SCENE_SIZES[size]
    gen_device = "cuda" if host.device.type == "cuda" else "cpu"
    dm_dir = host.cfg.models_dir / "diffusion_models"
    offload = host.host_mod.clone_node(host.offload.OffloadManager, "scene-offload")

    # (a) Sana 1600M-class transformer resident, then the DC-AE decode
    pix = dfx.write("pixart_1600m", dm_dir / f"vramfit_pixart_d{depth}.safetensors", depth, device=gen_device)
    dc = host.vae("dcae_sana")
    z = structured_latent(dc_shape, seed=3)
    case = f"(a) PixArt-Sigma {pix['params'] / 1e9:.2f}B resident + DC-AE {dc_shape[2] * 32}² x{dc_shape[0]}"
    model = host.nodes.UNETLoader().load_unet(pathlib.Path(pix["path"]).name, "default")[0]
    host.tiled.decode(dc, {"samples": z[:1, :, :2, :2]})  # first use (cost-model calibration) outside the rows
    variants = [
        ("no offload: VAE Decode (ExtraModels' decode)", False, lambda: dc.decode(z)),
        ("no offload: Tiled VAE Decode (unload_others off)", False,
         lambda: host.tiled.decode(dc, {"samples": z}, unload_others=False).images),
        ("Offload Manager -> VAE Decode (ExtraModels' decode)", True, lambda: dc.decode(z)),
        ("Offload Manager -> Tiled VAE Decode", True, lambda: host.tiled.decode(dc, {"samples": z}).images),
        ("Offload Manager -> Tiled VAE Decode, 1 GB budget (the prefix in tiles at 2048²)", True,
         lambda: host.tiled.decode(dc, {"samples": z}, budget_mb=1024).images),
    ]
    ref = first_peak = None
    for name, with_offload, fn in variants:
        host.mm.load_models_gpu([model])  # resident, as after sampling

        def phase(fn: Callable[[], Any] = fn, with_offload: bool = with_offload) -> Any:
            if with_offload:
                offload.execute(value={"samples": z})
            return fn()

        out, m = measure(host.device, phase, host.tracker)
        ref = out if ref is None else ref
        first_peak = m["peak_abs_mib"] if first_peak is None else first_peak
        cut = None if not (first_peak and m["peak_abs_mib"]) else 100 * (1 - m["peak_abs_mib"] / first_peak)
        rows.add(case=case, decode=name, **m, **fidelity(out, ref), reference=variants[0][0],
                 decode_phase_cut_pct=cut)
        del out
    model = dc = ref = None  # released before (b)
    host.unload_all()

    # (b) InfiniteYou-class FLUX on a 24 GB budget: bf16 Loader -> (one transformer step) -> Offload -> decode
    flux = dfx.write("flux", dm_dir / f"vramfit_flux_d{fd}_{fs}.safetensors", fd, fs, device=gen_device)
    vae = host.vae("flux")
    zf = structured_latent(flux_shape, seed=4)
    case = f"(b) FLUX {flux['params'] / 1e9:.1f}B ({fd}/{fs} blocks, {flux_dtype}) + FLUX VAE {flux_shape[2] * 8}²"
    notes: list[str] = []

    def graph() -> Any:
        loader = host.host_mod.clone_node(host.bf16.Bf16Loader, "scene-loader").execute(
            model=f"diffusion_models/{pathlib.Path(flux['path']).name}", weight_dtype=flux_dtype)
        patcher = loader.result[0]
        host.mm.load_models_gpu([patcher])
        dm = patcher.model.diffusion_model
        dtype = patcher.model.get_dtype_inference() if hasattr(patcher.model, "get_dtype_inference") else torch.bfloat16
        x = torch.zeros(flux_shape, device=host.device, dtype=dtype)
        ctx = torch.zeros((1, 256, 4096), device=host.device, dtype=dtype)
        y = torch.zeros((1, 768), device=host.device, dtype=dtype)
        t = torch.full((1,), 0.5, device=host.device, dtype=dtype)
        try:
            with torch.inference_mode():
                dm(x, t, ctx, y=y, guidance=torch.full((1,), 3.5, device=host.device, dtype=dtype))
            notes.append("one transformer step ran")
        except Exception as e:  # recorded in the table: the decode part of the graph still runs
            notes.append(f"transformer step failed: {type(e).__name__}: {e}")
        offload.execute(value={"samples": zf}, keep=vae)
        return host.tiled.decode(vae, {"samples": zf})

    r, m = measure(host.device, graph, host.tracker)
    within = None if m["peak_abs_mib"] is None else m["peak_abs_mib"] <= 24 * 1024
    rows.add(case=case, decode="bf16 Loader -> step -> Offload Manager -> Tiled VAE Decode", **m,
             within_24gb=within, notes="; ".join(notes), **_plan_of(r))


PARTS = ("image", "encode", "video", "scenes")
DEFAULT_VIDEO_MODELS = "wan21,hunyuan_video15,ltx_video,mochi,cogvideox,wan22"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_parts")
    ap.add_argument("part", choices=PARTS)
    ap.add_argument("--json", type=pathlib.Path, required=True)
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU dry run)")
    ap.add_argument("--models", default="", help=f"video part: which VAEs (default {DEFAULT_VIDEO_MODELS}); encode part: "
                    "encode these video VAEs instead of the KL image, or dcae_sana (Sana's DC-AE, images)")
    ap.add_argument("--sizes", default="",
                    help="image and encode parts: comma-separated sides in px (default: the size's)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    size = "small" if args.small else "full"
    host = Host()
    rows = Rows(args.json, host.meta(args.part, size))
    log.info("part %s (%s) on ComfyUI %s, %s, dynamic VRAM: %s", args.part, size, host.cfg.version,
             host.device, host.host_mod.DYNAMIC_VRAM_STATUS)
    sizes = [int(v) for v in args.sizes.split(",") if v]
    if args.part == "image":
        part_image(host, rows, size, sizes)
    elif args.part == "encode" and args.models == "dcae_sana":
        part_encode(host, rows, size, sizes, kind="dcae_sana")
    elif args.part == "encode" and args.models:
        part_encode_video(host, rows, size, args.models.split(","))
    elif args.part == "encode":
        part_encode(host, rows, size, sizes)
    elif args.part == "video":
        part_video(host, rows, size, (args.models or DEFAULT_VIDEO_MODELS).split(","))
    else:
        part_scenes(host, rows, size)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
