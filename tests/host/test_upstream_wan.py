"""Qwen-Image 2.1's VAE, its TAESD and Wan 2.2 with 4-D latents on the newest upstream code (issue 41 items 2, 3).

The newest stored upstream VAE files (``tests/upstream/files``) are loaded over the ComfyUI 0.33.0 host for this module
(:func:`scripts.upstream.newest`, restored after) and the VAEs built as the newest ``comfy/sd.py`` builds them, narrow
and with random weights (``scripts/upstream_wan.py``). Each pack node's output equals what core ``VAEDecode`` /
``VAEEncode`` returns under the same overlay (float32, within 1e-4), shape and channels (RGBA) included:

* the crash of the issue (a (1, 64, 12, 10) latent on Qwen-Image 2.1's VAE raised from the cost model's host variant,
  the family read from the module's name) is gone;
* Qwen-Image 2.1's VAE decodes exactly in >= 4 tiles under a budget below its own decode's peak (the chunked Wan
  executor on a one-frame clip: the mid attention on the whole image, the up path in tiles);
* its TAESD is decoded within the budget (its decoder's own geometry: 0.33.0's ``taesd.py`` decodes 8x RGB where the
  newest ``sd.py`` declares 16x RGBA), and cannot encode, as core cannot;
* Wan 2.2's 4-D latents are single frames (core ``VAEDecode`` itself fails on them: its memory estimate reads a 5-D
  shape), equal to core on the 5-D latent and to the model's own 4-D decode.

Plus: the 0.33.0 host's own Wan 2.2 keeps its family and its exact path (first in the file: before the overlay).
ComfyUI 0.33.0 only: the overlay loads the newest files over that tree.
"""

from __future__ import annotations

import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from tests.helpers import pack_engine, require_0_33

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]

NODES = {"tiled": "VRAMFit_TiledVAEDecode", "video": "VRAMFit_TemporalChunkVideoDecode", "encode": "VRAMFit_TiledVAEEncode"}
ISSUE_LATENT = (1, 64, 12, 10)
"""The latent of the issue's crash (Tiled VAE Decode on Qwen-Image 2.1's VAE)."""
MiB = 2**20
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def host_0_33(comfy):
    require_0_33()


@pytest.fixture(scope="module")
def mods(comfy):
    return {k: sys.modules[comfy.NODE_CLASS_MAPPINGS[v].__module__] for k, v in NODES.items()}


def _engine(mods, name: str):
    return pack_engine(mods["tiled"], name)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert tuple(got.shape) == tuple(want.shape)
    assert (got.float() - want.float()).abs().max().item() <= TOL


# ------------------------------------------------------------------------------------------------ 0.33.0's own Wan 2.2


def test_host_wan22_keeps_its_exact_path(comfy, fixture_vaes, mods):
    """The 0.33.0 host's Wan 2.2 (narrow twin, before the overlay) is still ``wan22`` (its layout: 48 channels, patch
    2, temporal kernel 3) and decodes exactly through the chunked executor."""
    import comfy.ldm.wan.vae2_2 as host_vae2_2

    assert not hasattr(host_vae2_2, "conv3x3"), "the overlay is active: this test must run first"
    vae = fixture_vaes.load(comfy, "wan22_narrow")
    lay = _engine(mods, "vae.wan_layout").wan_layout(vae.first_stage_model)
    assert (lay.latent_channels, lay.patch, lay.temporal_kernel, lay.out_channels) == (48, 2, 3, 3)
    assert _engine(mods, "vae.families").identify(vae) == "wan22"
    z = structured_latent((1, 48, 2, 3, 3), seed=3)
    ref = comfy.VAEDecode().decode(vae, {"samples": z})[0]
    r = mods["video"].decode(vae, {"samples": z}, tile_size=32)  # 2 latent px: 2x2 tiles
    _close(r.images, ref)
    assert r.plan.path == "wan" and r.plan.exact and r.report.summary.startswith("exact")
    assert r.plan.config.grid == (2, 2)


# ------------------------------------------------------------------------------------------------ the newest code


@pytest.fixture(scope="module")
def newest_vaes(comfy):
    """``{name: VAE}`` built under the overlay, which stays on for the module and is restored after."""
    from scripts import upstream_wan
    from scripts.upstream import newest

    with newest():
        yield {"qwen21": upstream_wan.qwen21_vae(), "taesd": upstream_wan.qwen21_taesd(),
               "wan22": upstream_wan.wan22_vae()}


@pytest.fixture(scope="module")
def qwen_ref(comfy, newest_vaes):
    """The issue's latent and what core VAE Decode returns for it (under inference mode, as ComfyUI runs nodes)."""
    z = structured_latent(ISSUE_LATENT, seed=1)
    with torch.inference_mode():
        return z, comfy.VAEDecode().decode(newest_vaes["qwen21"], {"samples": z})[0]


def test_built_as_the_newest_sd_py(newest_vaes, mods):
    """The attributes of the newest branches; the family is read from the structure, and the cost-model subject
    (the issue's crash site: ``host_variant``) builds for every VAE."""
    qwen, taesd, wan = newest_vaes["qwen21"], newest_vaes["taesd"], newest_vaes["wan22"]
    assert (qwen.latent_dim, qwen.upscale_ratio, qwen.latent_channels, qwen.output_channels) == (2, 16, 64, 4)
    assert (taesd.upscale_ratio, taesd.output_channels, taesd.pad_channel_value) == (16, 4, 1.0)
    assert wan.latent_dim == 3 and wan.first_stage_model.patch_size == 2
    lay = _engine(mods, "vae.wan_layout").wan_layout(qwen.first_stage_model)
    assert (lay.latent_channels, lay.temporal_kernel, lay.patch, lay.out_channels, lay.spatial_ratio) == (64, 1, 1, 4, 16)
    families, calibration = _engine(mods, "vae.families"), _engine(mods, "cost.calibration")
    assert [families.identify(v) for v in (qwen, taesd, wan)] == [None, None, "wan22"]
    for v in (qwen, taesd, wan):
        calibration.subject(v)


def test_issue_crash_qwen21_1x64x12x10(newest_vaes, mods, qwen_ref):
    """The issue: Tiled VAE Decode of a (1, 64, 12, 10) latent on Qwen-Image 2.1's VAE raised a RuntimeError from
    ``cost/calibration.host_variant``. Now the pack's own path (VRAMFIT_STRICT: no fallback) returns core's RGBA image."""
    z, ref = qwen_ref
    r = mods["tiled"].decode(newest_vaes["qwen21"], {"samples": z})
    assert tuple(ref.shape) == (1, 192, 160, 4)
    _close(r.images, ref)
    assert r.report.summary.startswith("exact")


def test_qwen21_decode_exact_tiles_below_host_peak(newest_vaes, mods, qwen_ref):
    """Under a budget below the host decode's own peak (meta-sized), >= 4 exact tiles, equal to VAE Decode."""
    vae = newest_vaes["qwen21"]
    z, ref = qwen_ref
    sizing = _engine(mods, "measure.sizing")
    with sizing.MetaSizer([vae.first_stage_model], torch.float32, "cpu") as s:
        out = vae.first_stage_model.decode(torch.empty(ISSUE_LATENT))
        del out
    budget_mb = int(0.8 * s.peak_bytes) // MiB
    assert 0 < budget_mb * MiB < s.peak_bytes
    r = mods["tiled"].decode(vae, {"samples": z}, budget_mb=budget_mb)
    _close(r.images, ref)
    assert r.plan.path == "wan" and r.plan.exact and r.report.summary.startswith("exact")
    grid = r.plan.config.grid
    assert grid[0] * grid[1] >= 4
    assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB


def test_video_node_on_qwen21(newest_vaes, mods, qwen_ref):
    """Temporal-Chunk Video Decode takes the image latent to the image engine: core's RGBA image."""
    z, ref = qwen_ref
    _close(mods["video"].decode(newest_vaes["qwen21"], {"samples": z}).images, ref)


def _pixels(h: int, w: int) -> torch.Tensor:
    return torch.rand((1, h, w, 3), generator=torch.Generator().manual_seed(0))


def test_qwen21_encode(comfy, newest_vaes, mods):
    """Tiled VAE Encode returns VAE Encode's latent (RGB padded with opaque alpha, as the host pads it)."""
    vae, px = newest_vaes["qwen21"], _pixels(192, 160)
    ref = comfy.VAEEncode().encode(vae, px)[0]["samples"]
    assert tuple(ref.shape) == (1, 64, 12, 10)
    _close(mods["encode"].encode(vae, px).latent, ref)


@pytest.mark.slow
def test_qwen21_encode_exact_tiles_below_host_peak(comfy, newest_vaes, mods):
    """Under a budget below the host encode's own peak (meta-sized), >= 4 exact tiles, equal to VAE Encode. The
    encoder's reach is 10 latent px: tiles pay only from 512 px (about a minute on a 2-core CPU)."""
    vae, px = newest_vaes["qwen21"], _pixels(512, 512)
    ref = comfy.VAEEncode().encode(vae, px)[0]["samples"]
    sizing = _engine(mods, "measure.sizing")
    with sizing.MetaSizer([vae.first_stage_model], torch.float32, "cpu") as s:
        out = vae.first_stage_model.encode(torch.empty((1, 4, 512, 512)))
        del out
    budget_mb = int(0.8 * s.peak_bytes) // MiB
    r = mods["encode"].encode(vae, px, budget_mb=budget_mb)
    _close(r.latent, ref)
    assert r.report.summary.startswith("exact") and r.plan.path != "host"
    ny, nx = r.plan.config.grid((512, 512))
    assert ny * nx >= 4


def test_taesd_decode_and_encode(comfy, newest_vaes, mods):
    """Qwen-Image 2.1's TAESD: decoded within the budget by both decode nodes (its decoder's own 8x RGB, what VAE
    Decode returns); its encode fails as VAE Encode's does (0.33.0's encoder takes RGB, the VAE pads RGBA)."""
    vae = newest_vaes["taesd"]
    z = structured_latent(ISSUE_LATENT, seed=2)
    ref = comfy.VAEDecode().decode(vae, {"samples": z})[0]
    for node in ("tiled", "video"):
        r = mods[node].decode(vae, {"samples": z})
        _close(r.images, ref)
        assert r.report.summary.startswith("exact")
    px = _pixels(96, 80)
    with pytest.raises(RuntimeError) as core_error:
        comfy.VAEEncode().encode(vae, px)
    with pytest.raises(type(core_error.value)):
        mods["encode"].encode(vae, px)


def test_wan22_4d_latents(comfy, newest_vaes, mods):
    """Wan 2.2 on the newest ``vae2_2``: a 4-D latent is single frames, decoded as core decodes them as 5-D (core's
    own VAE Decode of the 4-D latent fails in its memory estimate) and as the model's own 4-D decode; an image
    encodes as VAE Encode encodes it."""
    vae = newest_vaes["wan22"]
    z = structured_latent((1, 48, 4, 4), seed=4)
    with pytest.raises(IndexError):
        comfy.VAEDecode().decode(vae, {"samples": z})
    ref = comfy.VAEDecode().decode(vae, {"samples": z.unsqueeze(2)})[0]
    own = vae.process_output(vae.first_stage_model.decode(z).float()).movedim(1, -1)
    _close(own, ref)
    for node in ("tiled", "video"):
        r = mods[node].decode(vae, {"samples": z})
        _close(r.images, ref)
        assert r.report.summary.startswith("exact")
    px = _pixels(64, 64)
    _close(mods["encode"].encode(vae, px).latent, comfy.VAEEncode().encode(vae, px)[0]["samples"])
