"""Encode bench: Tiled VAE Encode (exact tiles) vs core ``VAEEncode`` and ``VAEEncodeTiled``, one run.

For each image size, in one process, CPU float32, the random-weight SD/SDXL KL fixture (``--kinds`` for
FLUX.1 / FLUX.2 / Hunyuan Image / ``dcae_sana``, Sana's DC-AE as ExtraModels loads it, without the core tiled
row; with ``--frames N`` a video fixture, ``wan21``, ``ltx_video``,
``hunyuan_video15``: N frames of the size, through Temporal-Chunk Video Encode's engine):

1. core ``VAEEncode`` (untiled): the reference latent;
2. core ``VAEEncodeTiled`` with its defaults (tile 512, overlap 64);
3. Tiled VAE Encode at auto (free memory: the encoder's own forward when it fits);
4. Tiled VAE Encode under each ``--budgets`` fraction of the untiled encode's measured peak (default 0.8; exact
   tiles where the encoder's own forward does not fit; warmed first so the row times the encode, not the
   first-use check).

Per row: wall seconds, the live-tensor peak (``PeakTracker`` dispatch, the same measure for all rows), the
latent's max abs difference from the reference, and the PSNR of its round trip (``VAEDecode`` of the row's
latent vs ``VAEDecode`` of the reference latent; a latent within 1e-4 of the reference is not decoded: "same
latent"), with ratios vs the reference. ``--f64``: also each latent's max abs difference from a float64 copy of the
encoder (how far the host's own float32 encode is from the exact latent, and the rows from it). Each row is
logged as it finishes. Nothing is asserted; figures go
to docs/BENCHMARKS.md::

    .cache/venv/bin/python bench/encode.py [--sizes 1024 2048] [--kinds kl_f8] [--budgets 0.8 0.3] [--f64] [--threads 2]
    .cache/venv/bin/python bench/encode.py --kinds hunyuan_video15 --frames 17 --sizes 256 --budgets 0.5
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
log = logging.getLogger("vramfit.bench.encode")
log.setLevel(logging.INFO)
MiB = 2**20
SAME_LATENT = 1e-4
"""A row whose latent is within this of VAEEncode's (the exact rows) is not decoded for its PSNR: "same"."""


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def smooth_image(px: int) -> torch.Tensor:
    """A smooth image with detail (1, px, px, 3) on [0, 1] (also the GPU suite's ``encode`` part's input)."""
    g = torch.Generator().manual_seed(px)
    y = torch.linspace(0, 1, px).view(1, px, 1, 1)
    x = torch.linspace(0, 1, px).view(1, 1, px, 1)
    base = 0.5 + 0.3 * torch.sin(9 * x + 5 * y + torch.tensor([0.0, 1.0, 2.0]))
    return (base + 0.1 * torch.rand(1, px, px, 3, generator=g)).clamp(0, 1)


def _measure(tracker_mod: Any, fn: Callable[[], Any]) -> dict[str, Any]:
    w0 = time.perf_counter()
    with torch.inference_mode(), tracker_mod.PeakTracker("cpu", method="dispatch") as t:
        out = fn()
    return {"out": out, "wall": time.perf_counter() - w0, "peak": t.peak_bytes}


def _add(rows: list[dict[str, Any]], row: dict[str, Any]) -> None:
    """Append a row and log it at once (a long run shows its progress; the table comes at the end)."""
    rows.append(row)
    log.info("row: %s | %s | %.2f s | %.1f MiB", row["case"], row["encode"], row["wall"], row["peak"] / MiB)


def _load(nodes: Any, kind: str) -> Any:
    from scripts.fixtures.files import load_vae
    from scripts.host import HostConfig

    return load_vae(nodes, kind, HostConfig.load().models_dir / "vae")


def bench(nodes: Any, enc_mod: Any, tracker_mod: Any, kind: str, px: int,
          budgets: tuple[float, ...] = (0.8,), f64: bool = False, frames: int = 1) -> list[dict[str, Any]]:
    vae = _load(nodes, kind)
    pixels = smooth_image(px) if frames <= 1 else smooth_video(frames, px)
    case = f"{kind} {px}²" + (f" x {frames} frames" if frames > 1 else "")
    rows = []
    ref = _measure(tracker_mod, lambda: nodes.VAEEncode().encode(vae, pixels)[0]["samples"])
    _add(rows, {"case": case, "encode": "core VAEEncode (untiled)", **ref})
    if hasattr(vae, "process_input"):  # not for ExtraModels' EXVAE (Sana's DC-AE): core's tiled encode cannot run it
        core = _measure(tracker_mod, lambda: nodes.VAEEncodeTiled().encode(vae, pixels, 512, 64)[0]["samples"])
        _add(rows, {"case": case, "encode": "core VAEEncodeTiled 512/64", **core})
    auto = _measure(tracker_mod, lambda: enc_mod.encode(vae, pixels))
    _add(
        rows,
        {
            "case": case,
            "encode": f"Tiled VAE Encode, auto ({auto['out'].plan.description})",
            **auto,
            "out": auto["out"].latent,
        }
    )
    with torch.inference_mode():  # first use (self-check) outside the rows: 2x2 tiles of a corner
        r = int(vae.spacial_compression_encode()) if frames > 1 else 32
        enc_mod.encode(vae, pixels[:9, : 4 * r, : 4 * r], tile_size=2 * r)
    for frac in budgets:
        budget = max(1, int(frac * ref["peak"] / MiB))
        try:
            tiled = _measure(tracker_mod, lambda budget=budget: enc_mod.encode(vae, pixels, budget_mb=budget))
        except Exception as e:  # the node's input error: no plan fits (the tiles' floor is above the budget)
            if type(e).__name__ != "NodeInputError":
                raise
            log.info("row: %s | %s MiB (%gx) refused: %s", case, f"{budget:,}", frac, e)
            continue
        _add(
            rows,
            {
                "case": case,
                "encode": f"Tiled VAE Encode, {budget:,} MiB ({frac:g}x; {tiled['out'].plan.description})",
                **tiled,
                "out": tiled["out"].latent,
            }
        )
    with torch.inference_mode():
        (img_ref,) = nodes.VAEDecode().decode(vae, {"samples": ref["out"]})
        for r in rows:
            r["time_x"] = r["wall"] / ref["wall"]
            r["peak_x"] = r["peak"] / ref["peak"]
            r["max_abs"] = (r["out"].float() - ref["out"].float()).abs().max().item()
            if r["max_abs"] <= SAME_LATENT:  # the same latent decodes to the same image: no decode needed
                r["psnr"] = math.inf
                continue
            (img,) = nodes.VAEDecode().decode(vae, {"samples": r["out"]})
            r["psnr"] = _psnr(img, img_ref)
            log.info("row: %s | %s | latent max abs %.2g | round-trip PSNR %.1f dB", r["case"], r["encode"],
                     r["max_abs"], r["psnr"])
    if f64:
        _vs_float64(vae, pixels, rows)
    log.info("\n%s", table(rows))
    return rows


def smooth_video(frames: int, px: int) -> torch.Tensor:
    """``frames`` frames of :func:`smooth_image`, each shifted 3 px further (a slow pan): (frames, px, px, 3)."""
    img = smooth_image(px)
    return torch.cat([torch.roll(img, shifts=3 * t, dims=2) for t in range(frames)])


def _vs_float64(vae: Any, pixels: torch.Tensor, rows: list[dict[str, Any]]) -> None:
    """Log each row's latent max abs difference from the encoder's float64 copy (the same image, ComfyUI's
    ``[0, 1] -> [-1, 1]`` mapping; the regularizer's mean)."""
    import copy

    with torch.inference_mode():
        model = copy.deepcopy(vae.first_stage_model).double()
        exact = model.encode(pixels.movedim(-1, 1).double() * 2.0 - 1.0)
        exact = exact[0] if isinstance(exact, tuple) else exact
        del model
    top = exact.abs().max().item()
    for r in rows:
        diff = (r["out"].double() - exact).abs().max().item()
        log.info("row: %s | %s | latent max abs vs float64 %.2g (latent max %.2g)", r["case"], r["encode"], diff, top)


def predict(nodes: Any, enc_mod: Any, kind: str, px: int, frames: int, least: int = 128) -> list[str]:
    """The planner's meta-sized peaks (no encode runs) of one item: the encoder's own forward and the exact tiles
    of every candidate side down to ``least`` px, as table rows (``--predict``)."""
    pe = importlib.import_module(enc_mod.__name__.rsplit(".nodes.", 1)[0] + ".memory.plan.encode")
    vae = _load(nodes, kind)
    pixels = smooth_image(px) if frames <= 1 else smooth_video(frames, px)
    job = enc_mod._validate(vae, pixels, 0)
    case = f"{kind} {px}²" + (f" x {frames} frames" if frames > 1 else "")
    peaks = pe.PeakStore()
    w0 = time.perf_counter()
    whole = pe.encode_peak(job, None, peaks, 1 << 30)
    rows = [f"| {case} | the encoder's own forward | {whole / MiB:,.1f} | 1.00x |"]
    for cfg in pe.candidates(job):
        if cfg.store != "device" or cfg.tile < least:
            continue
        peak = pe.encode_peak(job, cfg, peaks, 1 << 30)
        rows.append(f"| {case} | exact tiles of {cfg.tile} px (halo {job.halo * (job.prefix_ratio or job.ratio)} px) | {peak / MiB:,.1f} | "
                    f"{peak / whole:.2f}x |")
        log.info("%s", rows[-1])
    log.info("predicted %s in %.0f s", case, time.perf_counter() - w0)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| case | encode | time (s) | vs VAEEncode | peak (MiB) | vs VAEEncode | latent max abs "
            "| round-trip PSNR |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        psnr = "same latent" if math.isinf(r["psnr"]) else f"{r['psnr']:.1f} dB"
        lines.append(
            f"| {r['case']} | {r['encode']} | {r['wall']:.2f} | {r['time_x']:.2f}x | {r['peak'] / MiB:,.1f} "
            f"| {r['peak_x']:.2f}x | {r['max_abs']:.2g} | {psnr} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--kinds", nargs="+", default=["kl_f8"])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.8],
                        help="budgets of the tiled rows, as fractions of the untiled encode's measured peak")
    parser.add_argument("--f64", action="store_true", help="also log each latent's distance to a float64 encode")
    parser.add_argument("--frames", type=int, default=1, help="a video of this many frames (video kinds)")
    parser.add_argument("--predict", action="store_true",
                        help="only the planner's meta-sized peaks (untiled and tiles of at least 128 px), no encode")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from scripts.host import load_comfy_in_process

    torch.set_num_threads(args.threads)
    nodes = load_comfy_in_process()
    enc_mod = sys.modules[nodes.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEEncode"].__module__]
    tracker_mod = importlib.import_module(
        enc_mod.__name__.rsplit(".nodes.", 1)[0] + ".memory.measure.tracker"
    )
    t0 = time.perf_counter()
    if args.predict:
        lines = ["| case | plan | predicted peak (MiB) | vs untiled |", "|---|---|---|---|"]
        for kind in args.kinds:
            for px in args.sizes:
                lines += predict(nodes, enc_mod, kind, px, args.frames)
        log.info("\n%s\n\nmeta-sized, %s, torch %s, %.0f s", "\n".join(lines), platform.platform(),
                 torch.__version__, time.perf_counter() - t0)
        return 0
    rows = [
        r for kind in args.kinds for px in args.sizes
        for r in bench(nodes, enc_mod, tracker_mod, kind, px, tuple(args.budgets), args.f64, args.frames)
    ]
    try:
        load = " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    log.info(
        "\n%s\n\nfixture VAEs (random weights, real architectures), float32, CPU, torch %s, %d threads, "
        "%s, load average %s, bench %.0f s",
        table(rows),
        torch.__version__,
        args.threads,
        platform.platform(),
        load,
        time.perf_counter() - t0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
