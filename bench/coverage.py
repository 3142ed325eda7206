"""Coverage bench: the exact tiled decode of each newly covered image family vs the host's decodes, one run.

For each fixture kind (default: Hunyuan Image 2.1 ``hunyuan_image``, Sana's DC-AE ``dcae_sana``; also Mage-VAE
``mage`` / ``mage_narrow`` on 0.33.0) and image
size, in one process, CPU float32:

1. the host's untiled decode (core ``VAEDecode``; for DC-AE, loaded as ComfyUI_ExtraModels does, its own
   ``VAE.decode``): the reference;
2. core ``VAEDecodeTiled`` with its defaults (tile 512, overlap 64; DC-AE: not a ComfyUI VAE, core's tiled
   decode cannot run it, the row says so);
3. Tiled VAE Decode with ``tile_size`` = half the image side (2x2 tiles at least), warmed first so the row
   times the decode, not the first-use check.

``--video``: the video VAEs of the carried-context executor (``--video-kinds``: Mochi, HunyuanVideo 1.5,
LTX-Video, CogVideoX where the host has it) on a ``--frames``-latent-frame clip of ``--video-px``: the host's ``VAEDecode``, core
``VAEDecodeTiled`` with its defaults (tile 512 / overlap 64, temporal 64 / 8) and, for clips of more than 24
frames, with temporal chunks of 24 frames (overlap 8), and Temporal-Chunk Video Decode with ``frames_per_chunk`` 2 (exact carried chunks; LTX-Video:
the whole clip; CogVideoX: 4 frames, its host's chunk), for the families that tile 2x2 tiles, and for the ones
that chunk in time a ``budget_mb`` between the predictions with the carried context kept for a rollback and spent
in place (the planner then spends it in place). Every row draws the decode's noise (LTX-Video) from
one random state.

``--families``: the families of ``comfy/sd.py`` no fixture file covers (TAESD, the SD x4 upscaler's KL VAE, Stable
Cascade's Stage A and Stage C previewer, the pixel-space pass-through, TAEHV for Wan 2.1, SVD's temporal decoder
on a 3-frame batch; also Mage-VAE's narrow fixture), each built by
``comfy.sd.VAE`` from random weights of the host's own classes (the keys it detects): the host's decode and encode
vs Tiled VAE Decode (Temporal-Chunk Video Decode for TAEHV) with tiles of a quarter of the output's side and Tiled
VAE Encode with tiles of half the image's side: the path each takes, whether it says exact, PSNR and max abs
difference. For README's coverage tables.

``--video --predict FRAMES``: nothing decoded; the planner's bfloat16 figures (meta sizing, within a few % of the
measured peaks at the sizes above) for clips of FRAMES frames at 480p, 720p and 1080p: the host's decode, exact
whole frames with the context kept and spent in place, exact 4x4 tiles, and the auto plan under 6 / 12 / 24 GiB
with its cold planning time (what a shape's first decode spends planning).

Per row: wall seconds, the live-tensor peak (``PeakTracker`` dispatch: the same measure for all rows), PSNR
vs the reference, and ratios vs the reference (time, peak). Nothing is asserted; figures go to
docs/BENCHMARKS.md::

    .cache/venv/bin/python bench/coverage.py [--kinds hunyuan_image dcae_sana] [--sizes 512] [--threads 2]
                                             [--video [--video-kinds mochi hunyuan_video15 ltx_video ltx_video_v0 ltx_video_v1 cogvideox] [--frames 8]
                                              [--video-px 128] [--predict 121]]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("vramfit.bench.coverage")
log.setLevel(logging.INFO)
MiB = 2**20
KINDS = ("hunyuan_image", "dcae_sana")
MORE_KINDS = ("hunyuan_image_narrow", "mage", "mage_narrow")
"""Also accepted by ``--kinds`` (Mage-VAE: ComfyUI 0.33.0+)."""


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _load(nodes: Any, kind: str) -> Any:
    from scripts.fixtures.files import load_vae
    from scripts.host import HostConfig

    return load_vae(nodes, kind, HostConfig.load().models_dir / "vae")


def _measure(tracker_mod: Any, fn: Callable[[], torch.Tensor]) -> dict[str, Any]:
    w0 = time.perf_counter()
    with torch.inference_mode(), tracker_mod.PeakTracker("cpu", method="dispatch") as t:
        out = fn()
    return {"out": out, "wall": time.perf_counter() - w0, "peak": t.peak_bytes}


def bench(nodes: Any, mod: Any, tracker_mod: Any, kind: str, px: int) -> list[dict[str, Any]]:
    from scripts.fixtures.kinds import FIXTURES
    from scripts.fixtures.latents import structured_latent
    from scripts.host import core_decode_tiled

    spec = FIXTURES[kind]
    vae = _load(nodes, kind)
    side = px // spec.spatial_ratio
    z = structured_latent((1, spec.latent_channels, side, side), seed=5)
    comfy_vae = kind != "dcae_sana"
    rows = []
    ref = _measure(tracker_mod, (lambda: nodes.VAEDecode().decode(vae, {"samples": z})[0]) if comfy_vae
                   else (lambda: vae.decode(z)))
    rows.append({"kind": kind, "px": f"{px}²", "decode": "host untiled (VAEDecode)", **ref, "psnr": math.inf})
    if comfy_vae:
        t = _measure(tracker_mod, lambda: core_decode_tiled(nodes, vae, {"samples": z}, 512, 64, 64, 8))
        rows.append({"kind": kind, "px": f"{px}²", "decode": "core VAEDecodeTiled 512/64", **t,
                     "psnr": _psnr(t["out"], ref["out"])})
    else:
        rows.append({"kind": kind, "px": f"{px}²", "decode": "core VAEDecodeTiled 512/64",
                     "skipped": "not a ComfyUI VAE (ExtraModels' EXVAE): core's tiled decode cannot run it"})
    tile = px // 2
    mod.decode(vae, {"samples": z[..., : min(side, 4), : min(side, 4)]}, tile_size=tile)  # first use, untimed
    w0 = time.perf_counter()
    r = mod.decode(vae, {"samples": z}, tile_size=tile)
    wall = time.perf_counter() - w0
    rows.append({"kind": kind, "px": f"{px}²", "decode": f"Tiled VAE Decode, tile {tile} ({r.plan.path})",
                 "out": r.images, "wall": wall, "peak": r.measured_peak or 0,
                 "psnr": _psnr(r.images, ref["out"]), "summary": r.report.summary})
    log.info("%s %d: %s", kind, px, r.report.text())
    return rows


VIDEO_KINDS = ("mochi", "hunyuan_video15", "ltx_video", "ltx_video_v0", "ltx_video_v1", "cogvideox")
CHUNK = {"cogvideox": 4}
"""Chunk size of the exact rows (CogVideoX counts decoded frames on its host's 4-frame grid; others: 2)."""


def _seeded(fn: Callable[[], Any]) -> Any:
    """``fn()`` from one random state (LTX-Video's decode draws noise: every row draws the same)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return fn()


def _engine(video: Any) -> tuple[Any, Any]:
    """``(memory.decode.video, memory.plan.video)`` of the package the node ``video`` (its module) comes from."""
    pkg = video.__name__.rsplit(".nodes.", 1)[0]
    return (importlib.import_module(f"{pkg}.memory.decode.video"),
            importlib.import_module(f"{pkg}.memory.plan.video"))


def bench_video(nodes: Any, tracker_mod: Any, kind: str, frames: int, px: int) -> list[dict[str, Any]]:
    """A carried-context video VAE: the host's decode, core's tiled decode (defaults; 24-frame temporal chunks)
    and exact chunks of 2 latent frames (LTX-Video: one whole-clip chunk), and, where the family tiles, 2x2
    tiles (``tile_size`` = half the frame)."""
    from scripts.fixtures.host import available
    from scripts.fixtures.kinds import FIXTURES
    from scripts.fixtures.latents import structured_latent
    from scripts.host import core_decode_tiled

    if not available(kind):
        return [{"kind": kind, "px": f"{px}x{px}x{frames}", "decode": "-",
                 "skipped": f"this host has no {FIXTURES[kind].module} (ComfyUI >= {FIXTURES[kind].min_comfyui})"}]
    video = sys.modules[nodes.NODE_CLASS_MAPPINGS["VRAMFit_TemporalChunkVideoDecode"].__module__]
    vae = _load(nodes, kind)
    spec = FIXTURES[kind]
    r_s = spec.spatial_ratio
    z = structured_latent((1, spec.latent_channels, frames, px // r_s, px // r_s), seed=5)
    size = f"{px}x{px}x{frames}"
    ref = _measure(tracker_mod, lambda: _seeded(lambda: nodes.VAEDecode().decode(vae, {"samples": z})[0]))
    rows = [{"kind": kind, "px": size, "decode": "host untiled (VAEDecode)", **ref, "psnr": math.inf}]
    cores = [((512, 64, 64, 8), "core VAEDecodeTiled 512/64, 64/8 frames")]
    if ref["out"].shape[0] > 24:  # a shorter clip is one temporal tile either way
        cores.append(((512, 64, 24, 8), "core VAEDecodeTiled 512/64, 24/8 frames"))
    for args, label in cores:
        t = _measure(tracker_mod, lambda args=args: _seeded(
            lambda: core_decode_tiled(nodes, vae, {"samples": z}, *args)))
        rows.append({"kind": kind, "px": size, "decode": label, **t, "psnr": _psnr(t["out"], ref["out"])})
    k = CHUNK.get(kind, 2)
    video.decode(vae, {"samples": z[:, :, :5]}, frames_per_chunk=k)  # first use (self-check), untimed
    dv, pv = _engine(video)
    job = dv.make_job(vae, z, "cpu", frames_per_chunk=k)
    runs = [({"frames_per_chunk": k}, f"k {k}")]
    if job.carry.description.tiles:
        runs.append(({"frames_per_chunk": k, "tile_size": px // 2}, f"k {k}, tile {px // 2} px"))
    if job.carry.description.temporal:  # chunks in time: a budget between the two context modes' predictions
        rb, inplace = (pv.carry_planned(job, k, pv.PeakStore(), rollback=rollback) for rollback in (True, False))
        if inplace < rb:
            mid = (rb + inplace) / 2 / MiB
            runs.append(({"frames_per_chunk": k, "budget_mb": int(mid)}, f"k {k}, budget {mid:.0f} MiB"))
    for kw, label in runs:
        w0 = time.perf_counter()
        r = _seeded(lambda kw=kw: video.decode(vae, {"samples": z}, **kw))
        rows.append({"kind": kind, "px": size, "decode": f"Temporal-Chunk Video Decode, {label} ({r.plan.path}, "
                     f"{r.stats.get('chunks')} chunks)", "out": r.images, "wall": time.perf_counter() - w0,
                     "peak": r.measured_peak or 0, "psnr": _psnr(r.images, ref["out"])})
        log.info("%s: %s", kind, r.report.text())
    return rows


PREDICT_CLIPS = ((848, 480), (1280, 720), (1920, 1088))
PREDICT_BUDGETS_GIB = (6, 12, 24)


def predict_video(nodes: Any, kind: str, frames: int, dtype: torch.dtype) -> list[str]:
    """The planner's own figures at users' sizes (meta sizing, nothing decoded): per clip of ``frames`` video
    frames, the host's decode, exact whole frames (context kept / in place) and exact tiles, and the auto
    plan under each budget with its cold planning time (a fresh peak store: a shape's first decode)."""
    import dataclasses

    from scripts.fixtures.host import available
    from scripts.fixtures.kinds import FIXTURES

    if not available(kind):
        return [f"| {kind} | - | this host has no {FIXTURES[kind].module} | | | | |"]
    dv, pv = _engine(sys.modules[nodes.NODE_CLASS_MAPPINGS["VRAMFit_TemporalChunkVideoDecode"].__module__])
    vae = _load(nodes, kind)
    spec = FIXTURES[kind]
    r_s, r_t = spec.spatial_ratio, spec.temporal_ratio
    t = (frames - 1) // r_t + 1
    rows = []
    for w, h in PREDICT_CLIPS:
        z = torch.zeros((1, spec.latent_channels, t, h // r_s, w // r_s))
        job = dataclasses.replace(dv.make_job(vae, z, "cpu"), dtype=dtype)
        desc = job.carry.description
        k = t if not desc.temporal else desc.fit(CHUNK.get(kind, 2))
        peaks = pv.PeakStore()
        frames_out = pv.output_geometry(job)[0]
        host = pv.plan_host_decode(job, 1 << 62, peaks, "").planned
        kept = pv.carry_planned(job, k, peaks, None, True)
        spent = pv.carry_planned(job, k, peaks, None, False) if desc.temporal else kept
        side = max(2, math.ceil(max(z.shape[-2:]) / 4))
        tile = (min(side, z.shape[-2]), min(side, z.shape[-1]))
        tiled = pv.carry_planned(job, k, peaks, tile, not desc.temporal) if desc.tiles else None
        autos = []
        for gib in PREDICT_BUDGETS_GIB:
            t0 = time.perf_counter()
            p = pv.plan(job, gib << 30, pv.PeakStore())
            over = ", over" if p.over_budget else ""
            autos.append(f"{gib} GiB: {p.path} {p.description} ({p.planned / 2**30:.1f} GiB{over}; "
                         f"{time.perf_counter() - t0:.1f} s)")
        tiles = (f"{tiled / 2**30:.2f} ({tile[0]}x{tile[1]} latent px, halo {pv._job_halo(job)})"
                 if tiled is not None else "-")
        rows.append(f"| {kind} | {w}x{h}x{frames_out} | {host / 2**30:.2f} | {kept / 2**30:.2f} | "
                    f"{spent / 2**30:.2f} | {tiles} | {'<br>'.join(autos)} |")
        log.info("%s", rows[-1])
    return rows


def _random_vae(model: torch.nn.Module, prefix: str = "", **kw: Any) -> Any:
    """``comfy.sd.VAE`` of ``model``'s state dict (keys prefixed), ``model``'s layers given torch's initialisation
    (``comfy.ops`` layers skip it; :func:`scripts.fixtures.weights._torch_reset`), its own tensors left as built."""
    import comfy.sd

    from scripts.fixtures.weights import _torch_reset

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        for m in model.modules():
            _torch_reset(m)
    sd = {prefix + k: v for k, v in model.state_dict().items()}
    return comfy.sd.VAE(sd=sd, **kw)


def _family_vaes(nodes: Any = None) -> dict[str, Callable[[], tuple[Any, tuple[int, ...]]]]:
    """``{family: () -> (VAE, latent shape)}``: the families of ``comfy/sd.py`` without a fixture file (SVD's: three
    frames as its batch), and Mage-VAE's narrow fixture (its encode)."""

    def meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:  # small models: built on the CPU
        return build().float()

    def taesd():
        import comfy.taesd.taesd as t

        return _random_vae(meta(lambda: t.TAESD())), (1, 4, 32, 32)

    def x4_upscaler():
        from comfy.ldm.models.autoencoder import AutoencoderKL

        dd = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
              "ch_mult": [1, 2, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
        return _random_vae(meta(lambda: AutoencoderKL(ddconfig=dd, embed_dim=4))), (1, 4, 32, 32)

    def stage_a():
        from comfy.ldm.cascade.stage_a import StageA

        return _random_vae(meta(StageA)), (1, 4, 32, 32)

    def stage_c_previewer():
        from comfy.ldm.cascade.stage_c_coder import Previewer

        return _random_vae(meta(Previewer)), (1, 16, 16, 16)

    def svd():
        from comfy.ldm.models.autoencoder import AutoencodingEngine

        enc = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
               "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
        model = meta(lambda: AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": enc},
            decoder_config={"target": "comfy.ldm.modules.temporal_ae.VideoDecoder",
                            "params": dict(enc, video_kernel_size=[3, 1, 1], alpha=0.0)}))
        with torch.no_grad():
            for m in model.modules():
                if getattr(m, "mix_factor", None) is not None:
                    m.mix_factor.normal_()
        return _random_vae(model), (3, 4, 16, 16)

    def mage():
        return _load(nodes, "mage_narrow"), (1, 128, 4, 6)

    def hunyuan_video_image():  # a 4-D latent on HunyuanVideo 1.0's 3-D KL VAE: an image
        return _load(nodes, "hunyuan_video"), (1, 16, 16, 16)

    def pixel_space():
        import comfy.sd

        return comfy.sd.VAE(sd={"pixel_space_vae": torch.tensor(1.0)}), (1, 3, 128, 128)

    def taehv_wan21():
        import comfy.taesd.taehv as t

        return _random_vae(meta(lambda: t.TAEHV(latent_channels=16, latent_format=None))), (1, 16, 3, 16, 16)

    return {"taesd": taesd, "sd_x4_upscaler": x4_upscaler, "stage_a": stage_a,
            "stage_c_previewer": stage_c_previewer, "pixel_space": pixel_space, "taehv_wan21": taehv_wan21,
            "svd": svd, "mage_narrow": mage, "hunyuan_video_image": hunyuan_video_image}


def bench_families(nodes: Any, mod: Any, names: list[str]) -> list[str]:
    """One markdown row per family and direction (see ``--families``)."""
    from scripts.fixtures.latents import structured_latent

    video = sys.modules[nodes.NODE_CLASS_MAPPINGS["VRAMFit_TemporalChunkVideoDecode"].__module__]
    enc = sys.modules[nodes.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEEncode"].__module__]
    rows = []

    def row(name: str, what: str, r: Any, out: torch.Tensor, ref: torch.Tensor) -> str:
        ref = ref.reshape(out.shape) if ref.numel() == out.numel() else ref
        diff = (out.float() - ref.float()).abs().max().item() if out.shape == ref.shape else math.inf
        ps = _psnr(out.float().clamp(0, 1), ref.float().clamp(0, 1)) if what == "decode" else math.nan
        exact = "exact" if r.plan.exact else "approximate"
        return (f"| {name} | {what} | {r.plan.path} ({exact}) | {r.report.summary[:70]} | "
                f"{'bit-equal' if math.isinf(ps) else f'{ps:.1f} dB'} | {diff:.1e} |")

    for name in names:
        try:
            vae, shape = _family_vaes(nodes)[name]()
        except Exception as e:  # the host lacks the class, or builds it differently
            rows.append(f"| {name} | - | not built: {type(e).__name__}: {str(e)[:80]} | | | |")
            continue
        z = structured_latent(shape, seed=5)
        with torch.inference_mode():
            ref = nodes.VAEDecode().decode(vae, {"samples": z})[0].clone()
        side = int(ref.shape[-2])
        try:
            if len(shape) == 5:
                r = _seeded(lambda vae=vae, z=z, side=side: video.decode(vae, {"samples": z}, frames_per_chunk=1,
                                                                          tile_size=side // 2))
            else:
                r = mod.decode(vae, {"samples": z}, tile_size=max(32, side // 4 // 8 * 8))
            rows.append(row(name, "decode", r, r.images, ref))
            log.info("%s decode: %s", name, r.report.text())
        except Exception as e:
            rows.append(f"| {name} | decode | error: {type(e).__name__}: {str(e)[:100]} | | | |")
        if len(shape) == 5:
            continue
        try:
            with torch.inference_mode():
                lat = nodes.VAEEncode().encode(vae, ref)[0]["samples"].clone()
            r = enc.encode(vae, ref, tile_size=max(16, side // 2))
            out = r.latent["samples"] if isinstance(r.latent, dict) else r.latent
            rows.append(row(name, "encode", r, out, lat))
            log.info("%s encode: %s", name, r.report.text())
        except Exception as e:
            rows.append(f"| {name} | encode | error: {type(e).__name__}: {str(e)[:100]} | | | |")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| family | size | decode | wall s | tensor peak MiB | PSNR vs untiled | time vs untiled | "
           "peak vs untiled |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['kind']} | {r['px']} | {r['decode']} | {r['skipped']} | | | | |")
            continue
        ref = next(x for x in rows
                   if x["kind"] == r["kind"] and x["px"] == r["px"] and x["decode"].startswith("host"))
        ps = "ref" if r is ref else ("bit-equal" if math.isinf(r["psnr"]) else f"{r['psnr']:.1f} dB")
        out.append(f"| {r['kind']} | {r['px']} | {r['decode']} | {r['wall']:.1f} | {r['peak'] / MiB:,.0f} | "
                   f"{ps} | {r['wall'] / ref['wall']:.2f}x | {r['peak'] / max(1, ref['peak']):.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS + MORE_KINDS, default=list(KINDS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--video", action="store_true", help="bench the carried-chunk video VAEs instead")
    parser.add_argument("--video-kinds", nargs="+", choices=VIDEO_KINDS, default=list(VIDEO_KINDS))
    parser.add_argument("--frames", type=int, default=8, help="--video: latent frames")
    parser.add_argument("--video-px", type=int, default=128, help="--video: frame side in px")
    parser.add_argument("--predict", type=int, default=0, metavar="FRAMES",
                        help="--video: the planner's bf16 predictions at 480p/720p/1080p clips of FRAMES frames "
                             "instead of decodes")
    parser.add_argument("--families", nargs="*", default=None, metavar="FAMILY",
                        help="the families without a fixture file (all when none is named): taesd, sd_x4_upscaler, "
                             "stage_a, stage_c_previewer, pixel_space, taehv_wan21, svd, mage_narrow, hunyuan_video_image")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from scripts.host import load_comfy_in_process

    torch.set_num_threads(args.threads)
    nodes = load_comfy_in_process()
    mod = sys.modules[nodes.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]
    tracker_mod = importlib.import_module(mod.__name__.rsplit(".nodes.", 1)[0] + ".memory.measure.tracker")
    t0 = time.perf_counter()
    if args.families is not None:
        found = bench_families(nodes, mod, args.families or list(_family_vaes()))
        log.info("\n| family | direction | path | report | PSNR vs host | max abs diff |\n|---|---|---|---|---|---|"
                 "\n%s\n\nrandom weights, float32, CPU, torch %s, bench %.0f s", "\n".join(found), torch.__version__,
                 time.perf_counter() - t0)
        return 0
    if args.video and args.predict:
        head = ("| family | clip | host decode GiB | exact, whole frames GiB | in place GiB | exact, 4x4 tiles "
                "GiB | auto plan (cold planning time) |\n|---|---|---|---|---|---|---|")
        found = [r for kind in args.video_kinds for r in predict_video(nodes, kind, args.predict, torch.bfloat16)]
        log.info("\n%s\n%s\n\nbf16 meta sizing, torch %s, %s, bench %.0f s", head, "\n".join(found),
                 torch.__version__, platform.platform(), time.perf_counter() - t0)
        return 0
    if args.video:
        rows = [r for kind in args.video_kinds for r in bench_video(nodes, tracker_mod, kind, args.frames,
                                                                     args.video_px)]
    else:
        rows = [r for kind in args.kinds for px in args.sizes
                for r in bench(nodes, mod, tracker_mod, kind, px)]
    try:
        load = " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    log.info("\n%s\n\nfixture VAEs (random weights, real architectures), float32, CPU, torch %s, %d threads, "
             "%s, load average %s, bench %.0f s", table(rows), torch.__version__, args.threads,
             platform.platform(), load, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
