"""Cost models against real decodes of the fixture VAEs on the in-process ComfyUI host (CPU).

* a model calibrated from 3 small real decodes predicts the tracked peak of a real decode at a size
  not used for fitting within +-15 % (KL and Wan 2.1), and says so with the numbers;
* meta sizing (fake tensors, no compute) counts exactly the bytes a real decode counts, per family;
* the shipped defaults (meta-calibrated) predict the same held-out real decodes within +-15 %.

VAEs are loaded and decoded under ``torch.inference_mode`` (``tests.helpers.load_vae``; calibration runs
through ``decode_run``, which enters it), as ComfyUI's executor runs every node.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from vramfit.memory.cost.calibration import real_grid, subject, vae_key
from vramfit.memory.cost.phases import CostModelStore, calibrate
from vramfit.memory.geometry import Geometry
from vramfit.memory.measure.sizing import MetaSizer, decode_run, latent_shape
from vramfit.memory.measure.tracker import PeakTracker, tracker_factory
from vramfit.memory.vae.families import FAMILIES, identify

from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow_host
from tests.helpers import load_vae

pytestmark = pytest.mark.host
log = logging.getLogger("vramfit.tests.memory")

TOLERANCE = 0.15
# Held-out real decodes (not in real_grid nor in the meta fit grid): (family, out h/w px, latent frames)
HELD_OUT = {"kl_f8": ("kl", 192, 0), "wan21": ("wan21", 64, 3)}
KIND_FAMILY = {"kl_f8": "kl", "wan21": "wan21", "wan22_narrow": "wan22", "hunyuan_video": "hunyuan_video"}


def _load(comfy, fixture_vaes, kind):
    with narrow_host(kind):  # Wan 2.2: its narrow twin (the host's classes, a quarter of the channels)
        vae = load_vae(comfy, fixture_vaes[kind])  # under inference mode, as ComfyUI's executor loads it
    assert identify(vae) == KIND_FAMILY[kind]
    return vae


def _geometry(family: str, px: int, frames: int) -> Geometry:
    geo = FAMILIES[family].geometry
    return Geometry(
        latent_h=px // geo.spatial_ratio,
        latent_w=px // geo.spatial_ratio,
        latent_frames=frames,
        spatial_ratio=geo.spatial_ratio,
        temporal_ratio=geo.temporal_ratio,
    )


def _real_peak(vae, g: Geometry) -> int:
    """Tracked peak of a real decode of a *structured* latent (the calibration used random ones)."""
    z = structured_latent(latent_shape(g, vae.latent_channels), seed=1).to(vae.vae_dtype)
    with torch.inference_mode(), PeakTracker("cpu") as t:  # as ComfyUI runs nodes
        out = vae.first_stage_model.decode(z)
        del out
    return t.peak_bytes


@pytest.fixture(scope="module", params=[k if k == "kl_f8" else pytest.param(k, marks=pytest.mark.slow) for k in sorted(HELD_OUT)])
def held_out(request, comfy, fixture_vaes):
    """(kind, VAE, held-out geometry, its real tracked peak), one VAE in memory at a time."""
    kind = request.param
    family, px, frames = HELD_OUT[kind]
    vae = _load(comfy, fixture_vaes, kind)
    g = _geometry(family, px, frames)
    peak = _real_peak(vae, g)
    yield kind, vae, g, peak
    del vae
    gc.collect()


def _check(label: str, predicted: int, measured: int, record_property) -> None:
    err = (predicted - measured) / measured
    text = f"{label}: predicted {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB, error {err:+.1%}"
    log.info(text)
    record_property(label, text)
    assert abs(err) <= TOLERANCE, text + f" (tolerance +-{TOLERANCE:.0%})"


def test_real_calibration_predicts_held_out_real_decode(held_out, record_property) -> None:
    kind, vae, g, measured = held_out
    family = KIND_FAMILY[kind]
    geo = FAMILIES[family].geometry
    grid = real_grid(geo)
    assert g not in grid
    run = decode_run(vae.first_stage_model.decode, vae.latent_channels, vae.vae_dtype, "cpu")
    model = calibrate(
        run,
        grid,
        tracker_factory("cpu"),
        key=vae_key(subject(vae)),
        phases=FAMILIES[family].real_phases,
        source="test",
    )
    fit = ", ".join(f"{p.geometry.describe()}: {p.measured / 2**20:.2f} MiB" for p in model.points)
    log.info("%s fitted on [%s]: %s", kind, fit, model.describe())
    # larger than every fit point: this is an extrapolation, as the planner needs
    assert all(measured > p.measured for p in model.points)
    _check(f"{kind} real-calibrated, {g.describe()}", model.predict_tracked(g), measured, record_property)


def test_shipped_default_predicts_held_out_real_decode(held_out, record_property) -> None:
    kind, vae, g, measured = held_out
    model = CostModelStore(None).get(vae_key(subject(vae)))
    assert model is not None, f"no shipped default for {vae_key(subject(vae))}"
    assert all(p.geometry != g for p in model.points)
    _check(f"{kind} shipped default, {g.describe()}", model.predict_tracked(g), measured, record_property)
    # ComfyUI's own hand-set estimate for the same decode, for the record
    shape = latent_shape(g, vae.latent_channels)
    comfy_est = int(vae.memory_used_decode(shape, vae.vae_dtype))
    log.info(
        "%s %s: ComfyUI memory_used_decode %.1f MiB vs measured %.1f MiB (x%.2f)",
        kind,
        g.describe(),
        comfy_est / 2**20,
        measured / 2**20,
        comfy_est / measured,
    )


@pytest.mark.parametrize(
    "kind,px,frames",
    [("kl_f8", 96, 0), ("wan21", 32, 2), ("wan22_narrow", 32, 2), ("hunyuan_video", 32, 2)],
)
def test_meta_sizing_counts_what_a_real_decode_counts(comfy, fixture_vaes, kind, px, frames) -> None:
    vae = _load(comfy, fixture_vaes, kind)
    g = _geometry(KIND_FAMILY[kind], px, frames)
    run = decode_run(vae.first_stage_model.decode, vae.latent_channels, vae.vae_dtype, "cpu")
    with PeakTracker("cpu") as real:
        run(g)
    with MetaSizer([vae.first_stage_model], vae.vae_dtype) as meta:
        run(g)
    log.info("%s %s: real %d B, meta %d B", kind, g.describe(), real.peak_bytes, meta.peak_bytes)
    assert real.peak_bytes > 1 << 20
    assert meta.peak_bytes == real.peak_bytes
    # and the meta run left the real weights in place
    assert all(p.device.type == "cpu" for p in vae.first_stage_model.parameters())
    del vae
    gc.collect()
