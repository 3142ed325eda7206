"""Cost-model bench: calibrate every known VAE family and print predicted vs measured peaks.

For each family (fixture VAEs with the real ComfyUI architectures, loaded through ``comfy.sd.VAE``):

1. **meta calibration** (``memory.cost.calibration.calibrate_vae``): the decoder runs on fake tensors over
   ``fit_grid`` (64 px to 1.5-3 Kpx), no compute; one model per dtype (float32, bfloat16, float16);
2. **real sweep** (float32 on this CPU, the dtype ComfyUI uses on CPU): decodes at sizes *not* in
   the fit grid under the dispatch tracker; for each: measured peak, the model's prediction, the
   error, and the meta-sized peak of the same geometry (meta vs real, byte for byte);
3. **process overhead** (``--rss``, Linux): the two largest real sizes again under the ``rss``
   tracker; the slope of process RSS against the tracked peak, minus 1, is what the process grows
   beyond the tensor-level peak (oneDNN scratch and re-layouts, allocator). The largest slope over
   the families benched becomes ``CostModel.overhead`` of every CPU model (without ``--rss``: 0).

``--write`` stores the models, with their fit points, real checks and inputs, in
``memory/cost/data/<family>.json`` (the shipped defaults), replacing only the models of the same key: a family
whose memory depends on the host (``Family.host_keyed``, Wan) keeps one set of models per host variant
(``calibration.host_variant``: run the bench on each host).

The fixtures of no known family (``UNKNOWN_KINDS``: FLUX.2's ``AutoencoderKL`` with the latent BatchNorm,
Hunyuan Image 2.1's ``AutoencodingEngine``, Sana's DC-AE as ``scripts/sana_vae.py`` loads it) are benched the
same way under the key their first decode looks up (``calibration.vae_key``: the model class and a digest of
its structure) and written to
``memory/cost/data/<kind>.json``, so their first decode calibrates nothing either; a decoder with an exact
split path (``memory/vae/split_layout.py``: DC-AE) also gets its suffix's models (executor ``split``, meta
sizing).
Run from the repo root with
the host's python::

    .cache/venv/bin/python bench/cost_model.py [--families kl wan21 flux2] [--write] [--rss] [--no-real]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import math
import pathlib
import platform
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("vramfit.bench.cost_model")
log.setLevel(logging.INFO)

KIND_OF_FAMILY = {"kl": "kl_f8", "wan21": "wan21", "wan22": "wan22", "hunyuan_video": "hunyuan_video"}
UNKNOWN_KINDS = ("flux2", "hunyuan_image", "dcae_sana")
"""Fixture kinds of no known family: benched under their structure keys (``<kind>.json``)."""
DTYPES = ("float32", "bfloat16", "float16")

# Real decodes, float32 CPU: (output px h, w, latent frames, batch); none of these is in fit_grid.
# The two with the largest tracked peaks (>= 2x apart) also give the RSS slope (``--rss``).
REAL_SIZES: dict[str, list[tuple[int, int, int, int]]] = {
    "kl": [(96, 96, 0, 1), (96, 96, 0, 2), (160, 224, 0, 1), (192, 192, 0, 1), (288, 288, 0, 1)],
    "wan21": [(32, 32, 1, 1), (40, 40, 2, 1), (64, 64, 3, 1), (96, 96, 2, 1)],
    "wan22": [(32, 32, 1, 1), (48, 48, 2, 1), (64, 64, 3, 1), (96, 96, 2, 1)],
    "hunyuan_video": [(32, 32, 1, 1), (40, 40, 2, 1), (64, 64, 3, 1), (96, 96, 2, 1)],
    # multiples of 32 px (DC-AE) and 16 px (FLUX.2)
    "flux2": [(96, 96, 0, 1), (96, 96, 0, 2), (160, 224, 0, 1), (192, 192, 0, 1), (288, 288, 0, 1)],
    "dcae_sana": [(96, 96, 0, 1), (96, 96, 0, 2), (160, 224, 0, 1), (192, 192, 0, 1), (288, 288, 0, 1)],
    "hunyuan_image": [(96, 96, 0, 1), (96, 96, 0, 2), (160, 224, 0, 1), (192, 192, 0, 1), (288, 288, 0, 1)],
}


def _import_pack() -> Any:
    if "vramfit" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "vramfit", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["vramfit"] = module
        spec.loader.exec_module(module)
    return sys.modules["vramfit"]


def _load_vae(kind: str) -> Any:
    from scripts.fixtures.files import make_models
    from scripts.host import HostConfig, import_comfy

    cfg = import_comfy(HostConfig.load())
    path = make_models(cfg.models_dir / "vae", seed=0, kinds=[kind])[kind]
    if kind == "dcae_sana":  # not a ComfyUI model: loaded as ComfyUI_ExtraModels' ExtraVAELoader does
        import torch

        from scripts.sana_vae import load_dcae

        return load_dcae(str(path), torch.float32), path
    import comfy.sd
    import comfy.utils

    sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    return comfy.sd.VAE(sd=sd, metadata=metadata), path


def _mib(n: float) -> str:
    return f"{n / 2**20:10.1f} MiB"


def bench_family(family: str, real: bool, rss: bool) -> tuple[list[Any], float | None, str]:
    """The family's models (one per dtype), the measured RSS overhead (or None) and its note."""
    import torch
    from vramfit.memory.cost.calibration import calibrate_vae, subject
    from vramfit.memory.cost.phases import FitPoint
    from vramfit.memory.geometry import Geometry
    from vramfit.memory.measure.sizing import MetaSizer, decode_run
    from vramfit.memory.measure.tracker import PeakTracker, rss_supported
    from vramfit.memory.vae.families import FAMILIES, identify

    kind = KIND_OF_FAMILY.get(family, family)
    vae, path = _load_vae(kind)
    known = family if family in KIND_OF_FAMILY else None
    if identify(vae) != known:
        raise RuntimeError(f"{path.name} is recognised as {identify(vae)!r}, not {known!r}")
    from vramfit.memory.vae.families import model_name

    from scripts.fixtures.kinds import FIXTURES

    spec = FIXTURES[kind]

    def subject_of(**kw: Any) -> Any:  # as the node's job identifies it (ratio and channels of the latent)
        return subject(vae, family=known or model_name(vae), spatial_ratio=spec.spatial_ratio,
                       channels=spec.latent_channels, **kw)

    geo = FAMILIES[family].geometry if known else subject_of().geometry
    try:
        import comfyui_version

        comfy_version = comfyui_version.__version__
    except ImportError:
        comfy_version = "?"
    from vramfit.memory.plan.split import EXECUTOR as SPLIT
    from vramfit.memory.plan.split import PHASES as SPLIT_PHASES
    from vramfit.memory.plan.split import suffix_run
    from vramfit.memory.vae.split_layout import split_layout

    models, split_models = [], []
    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        t0 = time.perf_counter()
        m = calibrate_vae(subject_of(dtype=dt, device="cpu"))
        inputs = dict(m.inputs)
        inputs.update(
            fixture=path.name,
            fixture_seed=0,
            comfyui=comfy_version,
            bench="bench/cost_model.py",
            cpu_threads=torch.get_num_threads(),
            system=platform.platform(),
        )
        m = dataclasses.replace(m, inputs=inputs)
        log.info("%s %s: meta calibration in %.1f s", family, dt_name, time.perf_counter() - t0)
        log.info("  %s", m.describe())
        if split_layout(vae.first_stage_model).reason is None:  # the exact split path's suffix, too
            s = subject_of(dtype=dt, device="cpu")
            model = vae.first_stage_model
            run = suffix_run(split_layout(model), model, s.channels, dt, "cpu")
            fitted = calibrate_vae(s, executor=SPLIT, run=run, phases=SPLIT_PHASES)
            split_models.append(dataclasses.replace(fitted, inputs=inputs))
            log.info("  split suffix: %s", split_models[-1].describe())
        for g, meas, pred, err in m.errors():
            log.info(
                "    fit  %-62s measured %s predicted %s  %+6.1f%%",
                g.describe(),
                _mib(meas),
                _mib(pred),
                100 * err,
            )
        models.append(m)
    if not real:
        return models + split_models, None, ""

    m32 = models[0]
    run = decode_run(vae.first_stage_model.decode, spec.latent_channels, torch.float32, "cpu")
    checks = []
    log.info("%s float32: real decodes on %s (sizes not in the fit grid)", family, platform.machine())
    for h, w, t, b in REAL_SIZES[family]:
        g = Geometry(
            latent_h=h // geo.spatial_ratio,
            latent_w=w // geo.spatial_ratio,
            batch=b,
            latent_frames=t,
            spatial_ratio=geo.spatial_ratio,
            temporal_ratio=geo.temporal_ratio,
        )
        with MetaSizer([vae.first_stage_model], torch.float32) as meta:
            run(g)
        t0 = time.perf_counter()
        with PeakTracker("cpu") as tracker:
            run(g)
        dt = time.perf_counter() - t0
        checks.append(FitPoint(g, tracker.peak_bytes, dt))
        pred = m32.predict_tracked(g)
        log.info(
            "    real %-62s measured %s predicted %s  %+6.1f%%  meta %s (%s)  %.1f s",
            g.describe(),
            _mib(tracker.peak_bytes),
            _mib(pred),
            100 * (pred - tracker.peak_bytes) / tracker.peak_bytes,
            _mib(meta.peak_bytes),
            "= real"
            if meta.peak_bytes == tracker.peak_bytes
            else f"{meta.peak_bytes - tracker.peak_bytes:+d} B",
            dt,
        )
    overhead = 0.0
    note = ""
    if rss and rss_supported():
        # RSS = (1 + o) * tracked + f: the slope between the largest check and one >= 1.5x smaller is the untracked
        # overhead (oneDNN scratch/re-layouts, allocator); f (weight re-layouts, library caches) is a
        # fixed cost the CPU reserve covers.
        by_size = sorted(checks, key=lambda p: p.measured)
        top = by_size[-1]
        lower = [p for p in by_size if p.measured * 1.5 <= top.measured]  # a spread for the slope
        big = [lower[-1] if lower else by_size[-2], top]
        rss_points = []
        for p in big:
            with PeakTracker("cpu", method="rss") as rt:
                run(p.geometry)
            rss_points.append((p.measured, rt.peak_bytes))
            log.info(
                "    rss  %-62s tracked %s process RSS +%s (x%.2f)",
                p.geometry.describe(),
                _mib(p.measured),
                _mib(rt.peak_bytes),
                rt.peak_bytes / p.measured,
            )
        (t1, r1), (t2, r2) = rss_points
        slope = (r2 - r1) / (t2 - t1) if t2 >= 1.5 * t1 else r2 / t2
        overhead = math.ceil(max(0.0, slope - 1.0) * 20) / 20  # rounded up to 5 %
        fixed = max(0.0, r2 - (1 + overhead) * t2)
        note = (
            f"process RSS vs tracked peak on this CPU: slope {slope:.2f} -> overhead {overhead:.2f}; "
            f"fixed part {fixed / 2**20:.0f} MiB (covered by the CPU reserve); "
            f"points (tracked, rss) MiB: {[(round(a / 2**20, 1), round(b / 2**20, 1)) for a, b in rss_points]}"
        )
        log.info("    rss  %s", note)
    measured = overhead if note else None
    models = [dataclasses.replace(m, validation=tuple(checks)) if m is m32 else m for m in models]
    return models + split_models, measured, note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [*KIND_OF_FAMILY, *UNKNOWN_KINDS]
    parser.add_argument("--families", nargs="+", default=names, choices=names,
                        help="known families, or fixture kinds of no known family (UNKNOWN_KINDS)")
    parser.add_argument("--write", action="store_true", help="write memory/cost/data/<family>.json")
    parser.add_argument("--rss", action="store_true", help="measure process RSS overhead (Linux)")
    parser.add_argument("--no-real", action="store_true", help="meta calibration only (no real decodes)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    for noisy in ("root", "vramfit.memory.cost.phases"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    _import_pack()
    t0 = time.perf_counter()
    results = {f: bench_family(f, real=not args.no_real, rss=args.rss) for f in args.families}
    # One CPU overhead for every family: the largest slope measured, here or by an earlier run for the
    # families not benched now (their shipped CPU models). At these small sizes the RSS of one family alone
    # is too noisy (fixed costs and allocator reuse dominate), and the planner must not under-predict the
    # process on any of them.
    from vramfit.memory.cost.phases import DATA_DIR, CostModelStore
    from vramfit.memory.store import write_entries

    measured = {f: r[1] for f, r in results.items() if r[1] is not None}
    benched = {m.key.family for models, _, _ in results.values() for m in models}
    shipped = {m.key.family: m.overhead for m in CostModelStore(None).models()
               if m.key.device_type == "cpu" and m.key.family not in benched}
    overhead = max([*measured.values(), *shipped.values()], default=0.0)
    log.info("CPU process overhead: measured %s, shipped for other families %s -> %.2f for the CPU models written",
             {f: round(v, 2) for f, v in measured.items()}, shipped, overhead)
    for family, (models, _, note) in results.items():
        summary = (f"overhead = max over families measured now {sorted(measured.items())} and shipped "
                   f"{sorted(shipped.items())} = {overhead:.2f}" + (f"; this family: {note}" if note else ""))
        models = [
            dataclasses.replace(m, overhead=overhead if m.key.device_type == "cpu" else 0.0, notes=summary)
            for m in models
        ]
        if args.write:
            DATA_DIR.mkdir(exist_ok=True)
            target = DATA_DIR / f"{family}.json"
            new = {m.key for m in models}
            families = {m.key.family for m in models}
            kept = [m for m in CostModelStore(None).models() if m.key.family in families and m.key not in new]
            everything = sorted([*kept, *models], key=lambda m: m.key)
            write_entries(target, CostModelStore.section, CostModelStore.schema,
                          {str(m.key): m.to_dict() for m in everything})
            log.info("wrote %s (%d models, %d kept from other host variants)", target.relative_to(ROOT),
                     len(everything), len(kept))
    log.info("bench done in %.0f s", time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
