"""The VAE files of ComfyUI's official templates, built as the newest upstream ``comfy/sd.py`` builds them (issue 42
item 4; ``scripts/upstream_templates.py``).

For every file: the newest sd.py's detection chain and the branch that takes the file are the ComfyUI 0.33.0 host's,
line for line, so the host's own ``comfy.sd.VAE`` builds what the newest sd.py builds (over the newest stored VAE
modules, :func:`scripts.upstream.newest`); where a narrow twin is built, it is the structure the branch gives the
file (class, channels, latent format, ratios, output channels); a file whose structure an existing fixture has names
the tests that cover it.

For the structures no other test has (Qwen-Image-Layered's and Ming-Image's RGBA Wan 2.1 VAE; FLUX.2's small
decoder): both decode nodes and Tiled VAE Encode under a budget below the host's own (meta-sized) peak return what
core ``VAEDecode`` / ``VAEEncode`` return (float32, within 1e-4; RGBA included) or the host's own result with the
reason in the report (:data:`EXPECT`), never an exception, and leave their input unchanged.

ComfyUI 0.33.0 only: the newest files load over that tree (0.3.75 has no ``image_channels`` in its Wan 2.1 VAE, no
``decoder_ddconfig``, no CogVideoX or LTX 2.4 VAE).
"""

from __future__ import annotations

import logging
import math
import pathlib
import re
import sys

import pytest
import torch

from scripts.fixtures.kinds import FIXTURES
from scripts.fixtures.latents import structured_latent
from scripts.fixtures.weights import build_model
from scripts.upstream_templates import (
    BUILDERS,
    NEWEST_SD_PY,
    TEMPLATE_FILES,
    branch_headers,
    branch_text,
    state_dict,
    vae_from_state_dict,
)
from tests.helpers import pack_engine, require_0_33

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]

log = logging.getLogger("vramfit.tests.template_vaes")
ROOT = pathlib.Path(__file__).resolve().parents[2]
NODES = {"tiled": "VRAMFit_TiledVAEDecode", "video": "VRAMFit_TemporalChunkVideoDecode", "encode": "VRAMFit_TiledVAEEncode"}
FILES = {f.name: f for f in TEMPLATE_FILES}
NEW = tuple(f.name for f in TEMPLATE_FILES if f.covered_by is None)
MiB = 2**20
TOL = 1e-4

LATENTS = {
    # LatentCutToBatch's one-frame latents of a composite and one layer (a batch), and one of them alone
    "qwen_image_layered_vae": ((2, 16, 1, 12, 16), (1, 16, 1, 12, 16)),
    # one image in the Qwen-Image latent format (5-D, one frame)
    "ming_image_vae_bf16": ((1, 16, 1, 12, 16),),
    # EmptyFlux2LatentImage's (128 channels, 16x)
    "flux2-vae_small": ((1, 128, 6, 8),),
}
PIXELS = {"qwen_image_layered_vae": (1, 256, 256), "ming_image_vae_bf16": (1, 256, 256), "flux2-vae_small": (1, 96, 128)}
"""Batch, height, width of each file's encode test (RGB, as Load Image gives; the host pads the RGBA VAEs' alpha
with 1.0). Wan's encoder reaches 10 latent px (80 px): its tiles pay only from about 256 px."""
EXPECT = {
    "qwen_image_layered_vae": {"decode": ("host", "wan"), "encode": "exact"},
    "ming_image_vae_bf16": {"decode": ("wan",), "encode": "exact"},
    "flux2-vae_small": {"decode": ("exact",), "encode": "exact"},
}
"""The path each latent of :data:`LATENTS` (decode) and each image (encode) takes under a budget below the host's
own peak (``Plan.path``): "wan" the chunked Wan executor's exact tiles (one-frame clips), "exact" the KL walker's
exact tiles (decode) or the exact encode tiles (KL walker; Wan: the encoder's local part in tiles, its middle and
head on whole latents), "host" the host's own decode one batch item at a time, within the budget (a batch of
one-frame latents under a budget below the batch's peak but above one item's: the chunked executor's tiles hold
every item of the batch at once; the report's path row says so)."""


@pytest.fixture(scope="module", autouse=True)
def host_0_33(comfy):
    require_0_33()


@pytest.fixture(scope="module")
def mods(comfy):
    return {k: sys.modules[comfy.NODE_CLASS_MAPPINGS[v].__module__] for k, v in NODES.items()}


def _engine(mods, name: str):
    return pack_engine(mods["tiled"], name)


@pytest.fixture(scope="module")
def overlay(comfy):
    """The newest stored VAE modules in place of 0.33.0's for this module (restored after)."""
    from scripts.upstream import newest

    with newest() as loaded:
        yield loaded


@pytest.fixture(scope="module")
def built(overlay):
    """``{name: VAE}`` for the files with a builder, each built once (as ComfyUI's executor loads a VAE: under
    inference mode) under the overlay."""
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            sd = state_dict(name)
            with torch.inference_mode():
                cache[name] = vae_from_state_dict(sd)
        return cache[name]

    yield get
    import comfy.model_management as mm

    patchers = [v.patcher for v in cache.values()]
    others = [lm for lm in mm.current_loaded_models if lm.model not in patchers]
    mm.free_memory(1e30, mm.get_torch_device(), keep_loaded=others)  # later modules count loaded models
    cache.clear()


def _host_sd_py() -> pathlib.Path:
    import comfy.sd

    return pathlib.Path(comfy.sd.__file__)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    assert tuple(got.shape) == tuple(want.shape)
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= TOL, diff
    return diff


# ------------------------------------------------------------------------------------------------ how sd.py builds it


def test_newest_detection_chain_is_the_hosts():
    """The newest sd.py tests the same keys in the same order as 0.33.0's: a file reaches the same branch."""
    assert branch_headers(NEWEST_SD_PY) == branch_headers(_host_sd_py())


@pytest.mark.parametrize("name", [f.name for f in TEMPLATE_FILES])
def test_sd_py_builds_it(name, overlay, built, mods):
    """The newest sd.py's branch that takes the file is the host's, line for line; the narrow twin of a file with a
    builder is what that branch builds for the file (Wan 2.1 RGB files: the ``wan21`` fixture's key layout, class and
    geometry); a covered file names tests that exist."""
    f = FILES[name]
    newest = branch_text(NEWEST_SD_PY, f.branch, f.sub_branch)
    assert newest == branch_text(_host_sd_py(), f.branch, f.sub_branch), f"{name}: the newest sd.py's branch differs"
    if name not in BUILDERS:
        for ref in re.findall(r"(tests/host/\w+\.py)::(\w+)", f.covered_by or ""):
            path, test = ref
            assert f"def {test}(" in (ROOT / path).read_text(), ref
        assert f.covered_by
        return
    vae = built(name)
    fsm = vae.first_stage_model
    if BUILDERS[name]["builder"] == "wan21_rgba":
        c = BUILDERS[name]["channels"]
        assert type(fsm) is overlay["comfy.ldm.wan.vae"].WanVAE  # the newest vae.py (dcbf1c1)
        assert (vae.latent_channels, vae.latent_dim, vae.output_channels, vae.conv_out_channels) == (16, 3, c, c)
        assert vae.pad_channel_value == 1.0 and vae.spacial_compression_decode() == 8
        lay = _engine(mods, "vae.wan_layout").wan_layout(fsm)
        assert (lay.version, lay.latent_channels, lay.temporal_kernel, lay.patch, lay.out_channels,
                lay.spatial_ratio) == ("2.1", 16, 3, 1, c, 8)
        if c == 3:  # the wan21 fixture's structure (Qwen-Image's, Wan-Alpha's and Marigold's VAE), 1/4 of its width
            spec = FIXTURES["wan21"]
            fixture = {k: tuple(v.shape) for k, v in build_model("wan21").state_dict().items()}
            ours = {k: tuple(v.shape) for k, v in fsm.state_dict().items()}
            assert ours.keys() == fixture.keys()
            assert all(len(ours[k]) == len(fixture[k]) and ours[k][2:] == fixture[k][2:] for k in ours)
            assert (type(fsm).__name__, type(fsm).__module__, spec.latent_channels, spec.latent_dim,
                    spec.spatial_ratio, spec.temporal_ratio) == (spec.model_class, spec.module, 16, 3, 8, 4)
    else:  # FLUX.2's small decoder
        assert type(fsm).__name__ == "AutoencoderKL" and fsm.bn is not None
        assert fsm.encoder.conv_in.weight.shape[0] == 128 and fsm.decoder.conv_in.weight.shape[0] == 96 * 4
        assert (vae.latent_channels, vae.latent_dim, vae.spacial_compression_decode(), vae.output_channels) == (
            128, 2, 16, 3)
        assert type(fsm.decoder).__module__ == "comfy.ldm.modules.diffusionmodules.model"


# ------------------------------------------------------------------------------------------------ the new structures


def _host_peak(mods, fn) -> int:
    """Live tensor bytes at the peak of ``fn()`` (the pack's ``PeakTracker``, dispatch: what its reports measure)."""
    with _engine(mods, "measure.tracker").PeakTracker("cpu") as t:
        out = fn()
        del out
    return t.peak_bytes


@pytest.mark.parametrize("name", NEW)
def test_decode_below_the_hosts_peak(comfy, name, built, mods):
    """Both decode nodes under a budget below VAE Decode's own peak: VAE Decode's images (RGBA for the Wan 2.1 RGBA
    VAE) in >= 4 exact tiles within the budget (a batch of Qwen-Image-Layered's one-frame latents: the host's own
    decode one item at a time, within the budget, :data:`EXPECT`); the latent unchanged."""
    vae = built(name)
    for shape, path in zip(LATENTS[name], EXPECT[name]["decode"], strict=True):
        z = structured_latent(shape, seed=7)
        ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
        assert ref.shape[-1] == (4 if BUILDERS[name]["builder"] == "wan21_rgba" else 3) and ref.std().item() > 0.02
        peak = _host_peak(mods, lambda z=z: comfy.VAEDecode().decode(vae, {"samples": z})[0])
        budget_mb = int(0.8 * peak) // MiB
        assert 0 < budget_mb * MiB < peak
        for node in ("tiled", "video"):
            before = z.clone()
            r = mods[node].decode(vae, {"samples": z}, budget_mb=budget_mb)
            text = r.report.text()
            assert torch.equal(z, before), "the latent changed"
            diff = _close(r.images, ref)
            assert r.plan.path == path and r.plan.exact and r.report.summary.startswith("exact"), text
            if path == "host":
                assert "the host's own decode" in dict(r.report.rows)["path"], text
            elif path == "wan":
                assert r.plan.config.grid[0] * r.plan.config.grid[1] >= 4, text
            else:  # the KL walker: square tiles of config.tile px at every level
                assert not r.plan.config.whole, text
                assert math.prod(math.ceil(s / r.plan.config.tile) for s in ref.shape[1:3]) >= 4, text
            assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB, text
            log.info("%s %s %s: max abs diff %.2g, budget %d MiB, host peak %.1f MiB, measured %.1f MiB, %s", name,
                     shape, node, diff, budget_mb, peak / MiB, r.measured_peak / MiB, r.plan.description)


def test_ming_4d_latent(comfy, built, mods):
    """Ming-Image's latent as a 4-D image latent (EmptyLatentImage's, were its model's latent format 2-D): core VAE
    Decode fails on it (the Wan 2.1 branch's memory estimate reads a 5-D shape, the newest sd.py's too); both nodes
    decode it as the one-frame 5-D latent."""
    vae = built("ming_image_vae_bf16")
    z5 = structured_latent(LATENTS["ming_image_vae_bf16"][0], seed=7)
    ref = comfy.VAEDecode().decode(vae, {"samples": z5})[0]
    z = z5[:, :, 0].clone()
    with pytest.raises(IndexError):
        comfy.VAEDecode().decode(vae, {"samples": z})
    for node in ("tiled", "video"):
        before = z.clone()
        r = mods[node].decode(vae, {"samples": z}, budget_mb=3)
        assert torch.equal(z, before)
        _close(r.images, ref)
        assert r.plan.path == "wan" and r.report.summary.startswith("exact"), r.report.text()


def test_a_batch_of_layers_below_one_layers_own_peak(comfy, built, mods):
    """Qwen-Image-Layered's batch of one-frame latents under a budget below the host's decode of one layer and below
    the tiles of the whole batch at once (5.6 MiB): exact tiles one layer at a time within the budget, the host's
    images (before: "no plan fits")."""
    vae = built("qwen_image_layered_vae")
    z = structured_latent(LATENTS["qwen_image_layered_vae"][0], seed=7)
    ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
    one = _host_peak(mods, lambda: comfy.VAEDecode().decode(vae, {"samples": z[:1]})[0])
    budget_mb = 3
    assert budget_mb * MiB < one
    for node in ("tiled", "video"):
        r = mods[node].decode(vae, {"samples": z}, budget_mb=budget_mb)
        text = r.report.text()
        _close(r.images, ref)
        assert r.plan.path == "wan" and r.report.summary.startswith("exact"), text
        assert "one batch item at a time" in r.plan.description and " x 2 videos" in r.report.summary, text
        assert r.plan.config.grid[0] * r.plan.config.grid[1] >= 4, text
        assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB, text


@pytest.mark.parametrize("name", NEW)
def test_encode_below_the_hosts_peak(comfy, name, built, mods):
    """Tiled VAE Encode under a budget below VAE Encode's own peak: VAE Encode's latent (an RGB image padded with
    opaque alpha for the RGBA VAE, as the host pads it), in tiles, within the budget; the image unchanged."""
    vae = built(name)
    b, h, w = PIXELS[name]
    px = torch.rand((b, h, w, 3), generator=torch.Generator().manual_seed(0))
    ref = comfy.VAEEncode().encode(vae, px)[0]["samples"].clone()
    peak = _host_peak(mods, lambda: comfy.VAEEncode().encode(vae, px)[0]["samples"])
    budget_mb = int(0.8 * peak) // MiB
    assert 0 < budget_mb * MiB < peak
    before = px.clone()
    r = mods["encode"].encode(vae, px, budget_mb=budget_mb)
    text = r.report.text()
    assert torch.equal(px, before), "the image changed"
    diff = _close(r.latent, ref)
    assert r.plan.path == EXPECT[name]["encode"] and r.report.summary.startswith("exact"), text
    ny, nx = r.plan.config.grid((h, w))
    assert ny * nx >= 4, text
    assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB, text
    log.info("%s encode: max abs diff %.2g, budget %d MiB, host peak %.1f MiB, measured %.1f MiB, %s", name, diff,
             budget_mb, peak / MiB, r.measured_peak / MiB, r.plan.description)
