"""Temporal-Chunk Video Encode beyond Wan (issue 24): LTX-Video and HunyuanVideo 1.5 encoders through the
prefix/suffix split (``vae.encode_split`` + ``executors.split_encode``), on the host's own classes, vs the host's
own encode.

Thresholds: max abs diff vs ``model.encode`` <= 1e-5 (float32, tiny models from the host's classes), >= 4 tiles,
>= 3 temporal chunks per tile where the host chunks; a halo below the traced reach differs by > 1e-3 (so the tests
can fail); an OOM inside a tile splits it and resumes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from vramfit.memory.executors import split_encode as se
from vramfit.memory.vae import encode_split as es

from scripts.fixtures.narrow import narrow
from tests.video_refs import TINY_HV15_RATIO, TINY_LTX_RATIO, tiny_hv15, tiny_ltx

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread", "inference_mode")]
log = logging.getLogger("vramfit.tests.video_encode_families")


@pytest.fixture(scope="module")
def tiny(comfy):
    return {"ltx_video": (tiny_ltx(), TINY_LTX_RATIO), "hunyuan_video15": (tiny_hv15(), TINY_HV15_RATIO)}


def _x(ratio: int, frames: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((1, 3, frames, h * ratio, w * ratio), generator=g) * 2 - 1


def _halo(m, split, ratio):
    return se.split_halo(m, split, ratio, 3, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family", [pytest.param("ltx_video", marks=pytest.mark.slow), "hunyuan_video15"])
def test_split_equals_the_hosts_encode(tiny, family):
    m, ratio = tiny[family]
    split, reason = es.encode_split(m)
    assert reason is None and split.name == family
    x = _x(ratio, 17, 4, 28)
    calls = []
    out = se.encode_split_tiled(m, x, 3, ratio, split, progress=lambda d, t: calls.append(0))
    ref = m.encode(x)
    diff = (out - ref).abs().max().item()
    halo = _halo(m, split, ratio)
    log.info("%s: split vs encode max abs %.2e, halo %d latent px", family, diff, halo)
    assert out.shape == ref.shape and diff <= 1e-5
    assert len(calls) == 2 * 10 and 1 <= halo < 12


@pytest.mark.parametrize("family", ["ltx_video", "hunyuan_video15"])
def test_a_halo_below_the_reach_differs(tiny, family):
    m, ratio = tiny[family]
    split, _ = es.encode_split(m)
    x = _x(ratio, 9, 4, 28)
    halo = _halo(m, split, ratio)
    diff = (se.encode_split_tiled(m, x, 4, ratio, split, halo=max(0, halo - 2)) - m.encode(x)).abs().max().item()
    assert diff > 1e-3, (diff, halo)


@pytest.mark.parametrize("family", ["ltx_video", "hunyuan_video15"])
def test_oom_inside_a_tile_splits_it_and_resumes(tiny, family):
    m, ratio = tiny[family]
    split, _ = es.encode_split(m)
    x = _x(ratio, 9, 4, 12)
    ooms = []

    def fault(k: int) -> None:
        if k == 2:
            raise torch.OutOfMemoryError("injected")

    out = se.encode_split_tiled(m, x, 6, ratio, split, fault_hook=fault, on_oom=lambda: ooms.append(1))
    assert ooms == [1]
    assert (out - m.encode(x)).abs().max().item() <= 1e-5


def test_refiner_vae_is_not_split(comfy):
    """Hunyuan Image 2.1's refiner (``vae_refiner`` with ``refiner_vae`` False: GroupNorm over the clip) takes the
    host's encode, with the reason."""
    m = tiny_hv15()
    m.encoder.refiner_vae = False
    es._FOUND.pop(m, None)
    split, reason = es.encode_split(m)
    assert split is None and "GroupNorm" in reason


def test_a_global_module_in_the_prefix_is_refused(tiny):
    """The traced reach names a norm over space that runs in a prefix (a description that does not fit its
    encoder): the split is refused, not run approximately."""
    m, ratio = tiny_ltx(), TINY_LTX_RATIO
    split, _ = es.encode_split(m)
    blk = m.encoder.down_blocks[0].res_blocks[0]
    blk.norm1 = torch.nn.GroupNorm(2, blk.conv1.conv.in_channels)
    with pytest.raises(ValueError, match="global modules: encoder.down_blocks.0.res_blocks.0.norm1"):
        _halo(m, split, ratio)


# ------------------------------------------------------------------------------ the node on the fixtures
# (their narrow twins: the host's classes with a quarter of the channels, ``scripts.fixtures.kinds.NARROW_KINDS``)

NODE_CASES = {
    # family: (frames, h, w in latent px, tile px); >= 4 tiles across
    "ltx_video": (9, 1, 12, 96),
    "hunyuan_video15": (9, 1, 16, 64),
}


@pytest.mark.parametrize("family", [f if f == "ltx_video" else pytest.param(f, marks=pytest.mark.slow) for f in NODE_CASES])
def test_node_tiles_equal_vae_encode(comfy, fixture_vaes, family):
    import sys

    from vramfit.memory.decode.encode import VIDEO_REPORT_NODE

    from tests.host.test_tiled_encode_exact import _pixels

    mod = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEEncode"].__module__]
    vae = fixture_vaes.load(comfy, narrow(family))
    frames, h, w, tile = NODE_CASES[family]
    r = int(vae.spacial_compression_encode())
    pixels = _pixels(frames, h * r, w * r, seed=3)
    (ref,) = comfy.VAEEncode().encode(vae, pixels)
    out = mod.encode(vae, pixels, tile_size=tile, node=VIDEO_REPORT_NODE)
    rows = dict(out.report.rows)
    tiles = w * r // tile
    assert out.plan.path == "exact" and f"1x{tiles} tiles" in out.report.summary and tiles >= 4, out.report.text()
    assert "self-check passed" in rows["check"], out.report.text()
    assert rows["path"].startswith("exact: ") and "reach of" in rows["path"], rows["path"]
    diff = (out.latent - ref["samples"]).abs().max().item()
    log.info("%s node: tiles vs VAEEncode max abs %.2e; %s", family, diff, rows["path"])
    assert out.latent.shape == ref["samples"].shape and diff <= 1e-4


@pytest.mark.slow
def test_a_budget_below_the_untiled_peak_takes_tiles(comfy, fixture_vaes):
    """HunyuanVideo 1.5: a budget between the untiled encode's sized peak and that of tiles of 128 px: exact tiles,
    within it (the measured peak)."""
    import sys

    from vramfit.memory.plan import encode as pe

    from tests.host.test_tiled_encode_exact import _pixels

    mod = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEEncode"].__module__]
    vae = fixture_vaes.load(comfy, narrow("hunyuan_video15"))
    pixels = _pixels(9, 64, 768, seed=8)  # 4 x 48 latent px: tiles of 8 latent px reach 26 of them
    (ref,) = comfy.VAEEncode().encode(vae, pixels)
    job = mod._validate(vae, pixels, 0)
    untiled, tiled = (pe._out_bytes(job) + pe.encode_peak(job, cfg, pe.PeakStore(), 1 << 30)
                      for cfg in (None, pe.ExactEncode(128, "device")))
    assert tiled < 0.9 * untiled, (tiled, untiled)
    budget = (tiled + untiled) // 2 // 2**20
    r = mod.encode(vae, pixels, budget_mb=budget)
    assert r.plan.path == "exact", r.report.text()
    assert r.measured_peak is not None and r.measured_peak <= budget * 2**20, r.report.text()
    assert (r.latent - ref["samples"]).abs().max().item() <= 1e-4
